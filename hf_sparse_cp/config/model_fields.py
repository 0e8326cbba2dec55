"""Fields of a transformers model config that both the training path and the predictions on paper read (a leaf)."""

# The fields that give a mixture of experts its expert count (Mixtral, Qwen2-MoE / Qwen3-MoE, OLMoE, DeepSeek).
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")
