"""The fleet's model: which fingerprint every worker must serve, and where its tokenizer is.

The fingerprint is fixed by the coordinator's ``--model-fingerprint`` when given, else by the
first worker that registers with a lease (and it stays for the life of the process: a
restarted coordinator takes it from the first renewal, which is any worker of the running
fleet). A worker with another fingerprint is refused (`ModelMismatch`, FAILED_PRECONDITION).
Registrations without a fingerprint (a launcher naming a worker by address) are not checked.

The model name a registration carries is what the coordinator loads its tokenizer from
when it was started without ``--model``.
"""

from __future__ import annotations

import logging

from common.messages import Registration
from coordinator.errors import ModelMismatch

log = logging.getLogger(__name__)


class FleetModel:
    def __init__(self, fingerprint: str = "", model: str = "") -> None:
        self.fingerprint = fingerprint
        self.model = model
        self._pinned = bool(fingerprint)

    def admit(self, registration: Registration) -> None:
        """Raises ModelMismatch when ``registration`` serves another model; the first
        fingerprint seen becomes the fleet's unless one was configured."""
        offered = registration.model_fingerprint
        if not offered:
            if registration.lease_ttl_seconds > 0 and self.fingerprint:
                raise ModelMismatch(
                    registration.address, "", self.fingerprint, "a lease needs a fingerprint"
                )
            return
        if not self.fingerprint:
            self.fingerprint = offered
            log.info(
                "fleet model fingerprint %s, fixed by worker %s (%s)",
                offered,
                registration.address,
                registration.model or "model unnamed",
            )
        elif offered != self.fingerprint:
            why = "set by --model-fingerprint" if self._pinned else "fixed by the first worker"
            raise ModelMismatch(registration.address, offered, self.fingerprint, why)
        if not self.model and registration.model:
            self.model = registration.model
