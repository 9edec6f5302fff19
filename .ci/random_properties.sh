#!/usr/bin/env bash
# Every property test (hypothesis, marker "property") with fresh random examples under a few new
# seeds, printed so that a failure replays with
#     HYPOTHESIS_PROFILE=random python -m pytest -m property --hypothesis-seed=SEED
# The rest of the suite runs derandomised (the "ci" profile); this bounded run is what keeps the
# bounds honest on inputs nobody picked (docs/verification.md). A failure here is a bug in a
# kernel or in its bound: measure it, never just raise a budget. Run from the venv .ci/run made.
set -euo pipefail
cd "$(dirname "$0")/.."

seeds=${RANDOM_PROPERTY_SEEDS:-"$(python -c 'import secrets; print(*(secrets.randbelow(2**31) for _ in range(2)))')"}
for seed in $seeds; do
    echo "== property tests, fresh examples, --hypothesis-seed=$seed"
    HYPOTHESIS_PROFILE=random timeout "${RANDOM_PROPERTY_TIMEOUT:-240}" \
        python -m pytest -m property -q -p no:cacheprovider --hypothesis-seed="$seed"
done
