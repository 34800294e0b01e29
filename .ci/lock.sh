#!/usr/bin/env bash
# Rewrites constraints.txt: one fresh resolution of the test and integration extras in a new venv.
# aiobotocore (under s3fs) pins botocore to a narrow range and moto needs boto3, whose release N
# pins botocore N: without a hint pip takes the newest boto3 and backtracks through dozens of
# aiobotocore/s3fs/fsspec versions. The hint gives boto3 and botocore aiobotocore's own range.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
python -m venv "$work/venv"
"$work/venv/bin/pip" download --no-deps -q -d "$work" aiobotocore
range=$(python - "$work" <<'PY'
import glob, re, sys, zipfile
whl = zipfile.ZipFile(sorted(glob.glob(f"{sys.argv[1]}/aiobotocore-*.whl"))[-1])
meta = whl.read(next(n for n in whl.namelist() if n.endswith("METADATA"))).decode()
print(re.search(r"^Requires-Dist: botocore\s*([^;\n]+)", meta, re.M).group(1).strip())
PY
)
printf 'boto3%s\nbotocore%s\n' "$range" "$range" > "$work/hint.txt"
"$work/venv/bin/pip" install -q -c "$work/hint.txt" "torch==2.13.0" -e ".[test,integration]"
{
  echo "# The tested resolution of streampack's test and integration extras (Python 3.11, Linux, torch 2.13.0 CPU)."
  echo "# Every install in the README and .ci/run passes it with -c: pip then resolves without backtracking."
  echo "# Regenerate with: bash .ci/lock.sh (a fresh venv, one resolution, pip freeze; torch is pinned by the command)."
  "$work/venv/bin/pip" freeze --exclude-editable | grep -v -e '^-e' -e '^torch=='
} > constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) pins (botocore $range)"
