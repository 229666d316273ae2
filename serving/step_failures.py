"""How ``serving.engine.Engine`` fails a step (see the engine's docstring for the rules):
only the step's own requests, unless the failed device call had consumed the caches it
was donated; then every live request, and the engine starts again from empty pools. A
device that no longer answers raises ``DeviceLostError``."""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence

import jax
import numpy as np

from serving.outputs import FinishReason, RequestOutput
from serving.step import ScheduledStep

logger = logging.getLogger("serving.engine")  # the engine's log, where its users look


class DeviceLostError(RuntimeError):
    """The device stopped answering after a failed step; the engine cannot go on."""


class StepFailures:
    """The failure side of ``serving.engine.Engine`` (a mixin: it reads and changes the
    engine's ``scheduler``, ``caches``, ``steps``, ``_in_flight``, ``_tracked`` and
    ``_counts``, and calls its ``_make_pools``)."""

    def _fail_step(self, step: ScheduledStep, error: Exception) -> list[RequestOutput]:
        """Fails the step's requests (or, with the caches gone, every live request)."""
        self._counts["step_failures"] += 1
        if not self._caches_lost():
            self.scheduler.abort_step(step)
            self._in_flight = collections.deque(f for f in self._in_flight if f.step is not step)
            # Live requests of another step in flight that bear one of these ids stay.
            failed = [i for i in step.request_ids
                      if i in self._tracked and self.scheduler.get_request(i) is None]
            logger.error("step %d failed; failing its requests %s", step.step_id, failed,
                         exc_info=error)
            return self._fail_requests(failed)
        self._check_device(error)
        failed = list(self._tracked)
        logger.error("step %d failed after its caches were donated; failing every live request "
                     "%s and starting from empty pools", step.step_id, failed, exc_info=error)
        self._make_pools()
        self._counts["engine_resets"] += 1
        return self._fail_requests(failed)

    def _caches_lost(self) -> bool:
        """Whether the caches can no longer be used: a failed call consumed them (donated
        buffers deleted) or they hold an error the device reported after the call."""
        try:
            jax.block_until_ready(self.caches)
        except Exception:
            return True
        return any(leaf.is_deleted() for leaf in jax.tree.leaves(self.caches))

    def _fail_requests(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """Drops the requests (aborting those still live) and reports each finished with
        ``FinishReason.ERROR``."""
        outputs = []
        for request_id in request_ids:
            self.scheduler.abort(request_id)
            tracked = self._tracked.pop(request_id, None)
            if tracked is not None:
                self._counts["requests_failed"] += 1
                outputs.append(tracked.output(FinishReason.ERROR, None, None))
        return outputs

    def _check_device(self, error: Exception) -> None:
        """Raises ``DeviceLostError`` unless every device of the steps runs a tiny program."""
        devices = jax.devices() if self.steps.mesh is None else self.steps.mesh.devices.flat
        try:
            for device in devices:
                jax.block_until_ready(jax.device_put(np.zeros((), np.int32), device) + 1)
        except Exception as probe_error:
            raise DeviceLostError(f"the device failed after a step failed: {error!r}") from (
                probe_error
            )
