"""Serving: prefill planning, KV block and KDA state allocation, and the prefix cache.

- ``serving.plan``: which token spans a prompt is computed in, and which recurrent states
  each span retains (DESIGN section 6).
- ``serving.block_allocator``: MLA KV cache blocks with reference counts and the
  prefix-cache block map.
- ``serving.state_slots``: KDA state-pool slots for running requests and retained states.
- ``serving.prefix_cache``: longest-prefix lookup over both.
"""
