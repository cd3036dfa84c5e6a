"""Checkpoints: sharded save and load under the user's names (state_io), the keys and GPT-2's fused q|k|v rows in
saved state (keys, qkv), whole tensors gathered on rank 0 (gather), metadata read without running anything
(reader) and atomic replacement of a checkpoint directory (atomic_dir)."""
