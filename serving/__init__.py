"""Serving: prefill planning, KV block and KDA state allocation, and the prefix cache.

- ``serving.plan``: which token spans a prompt is computed in, and which recurrent states
  each span retains (DESIGN section 6).
- ``serving.block_allocator``: MLA KV cache blocks with reference counts and the
  prefix-cache block map.
- ``serving.state_slots``: KDA state-pool slots for running requests and retained states.
- ``serving.prefix_cache``: longest-prefix lookup over both.
- ``serving.request``: a request's tokens, status and the resources it holds.
- ``serving.scheduler``: per-step decodes and prefill spans, admission, preemption, and
  registering what each step retained (``serving.step_planner`` fills each step);
  ``serving.step``: what a scheduled step holds.
- ``serving.batch_builder``: a scheduled step packed into the model's bucketed batches
  (``serving.batch_validation``: their checks before the device).
- ``serving.sampling``: greedy / temperature / top-k / top-p sampling with per-request seeds.
- ``serving.engine``: the step loop over scheduler, model and sampler
  (``serving.engine_config``: its knobs; ``serving.step_failures``: a failed step);
  ``serving.outputs``: the request outputs and metrics it reports.
- ``serving.server``: the HTTP server (``serving.server_args``: its command line).
"""
