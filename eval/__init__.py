"""Evaluation harness for hf_specdec: speed and quality parity of decoding modes on coding tasks."""
