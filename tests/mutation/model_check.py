"""Two small CI configurations of the protocol model, for a mutant the tests let through:
exit status 1 if the real rules (as mutated) break one of the model's properties.

``not-idempotent`` and ``short-retention`` are the cheapest configurations (a few seconds
each) that still send, time out, look up, resend and reach key retention.
"""

from __future__ import annotations

import sys

from tests.model.__main__ import CI
from tests.model.engine import explore
from tests.model.protocol import ProtocolModel

CONFIGURATIONS = ("not-idempotent", "short-retention")


def main() -> int:
    for config in CI:
        if config.name in CONFIGURATIONS:
            result = explore(ProtocolModel(config), max_states=2_000_000)
            if result.violation is not None:
                print(f"{config.name}: {result.violation.property}")
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
