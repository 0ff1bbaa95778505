"""Knowledge transfer from a foundation model (FM) to vertical models (VMs): spec section (g).

- ``join``: as-of (point-in-time) join of logged FM embeddings onto examples and history events.
- ``adapter``: Student Adapter (calibrated soft targets from stale FM logits) and the KD loss.
- ``cache``: Solaris-style speculative pre-computation cache with an elastic compute budget.
- ``export``: runs a trained FM over a dataset and writes compact embeddings (ArrayRecord).
- ``loopfm``: LoopFM wrapper feeding FM embeddings to a VM as context / per-event features.
- ``settings``: the validated ``config.transfer`` section.
- ``experiment``: the transfer experiment's training, evaluation and cache-serving helpers.
"""
