"""The method on one layer: the annealed activation (schedule), the overcomplete projection and its exact fold (projection), fused MoE experts (experts). Knows nothing of Hugging Face models."""
