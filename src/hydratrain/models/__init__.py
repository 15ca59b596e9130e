"""Models. They know nothing of distribution: ``hydratrain.parallelize`` applies strategies to them."""
from hydratrain.models.gpt import GPT, Block

__all__ = ["GPT", "Block"]
