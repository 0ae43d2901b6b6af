"""Drafters: who proposes the guesses (``base.Drafter``). Import them from their modules."""
