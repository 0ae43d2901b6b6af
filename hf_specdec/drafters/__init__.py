from .base import Drafter, Proposal
from .draft_model import DraftModelDrafter

__all__ = ["Drafter", "Proposal", "DraftModelDrafter"]
