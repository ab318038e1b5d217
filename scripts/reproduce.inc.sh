# Sourced by scripts/reproduce_<paper>.sh after it sets TABLES (its sections) and SEEDS: moves to the repository root,
# sets PY (the Python to run; PY=echo prints the commands) and TABLE (the script's first argument, default all), and
# stops with exit 2 when TABLE is not one of TABLES (an override given in its place would otherwise run nothing).
cd "$(dirname "$0")/.."
PY=${PY:-python}
TABLE=${1:-all}
if [[ " $TABLES " != *" $TABLE "* ]]; then
  echo "error: unknown table '$TABLE': the first argument is one of: $TABLES; overrides follow it" \
    "(e.g. bash scripts/$(basename "$0") all trainer.devices=1)" >&2
  exit 2
fi
