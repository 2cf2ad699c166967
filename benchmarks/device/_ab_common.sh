# Shared by ab_gluon_forward.sh and ab_gluon_backward.sh (sourced, not run): the exp trees' own GPU
# tests, the summary of the alternating timing rounds, and one tarball of the run files.
# shellcheck shell=bash

ab_name_of() { basename "$(dirname "$1")"; }  # .ab/kfirst/src -> kfirst; .ab/src -> .ab

# ab_has_time NEEDED: true while at least NEEDED seconds are left of AB_BUDGET_S (default 560) counted
# from when this file was sourced; the timing rounds stop starting processes past it, so the summary
# and the tarball still come back inside one device call.
AB_T0=$(date +%s)
ab_has_time() { [ $((${AB_BUDGET_S:-560} - ($(date +%s) - AB_T0))) -ge "$1" ]; }

# ab_test_trees TEST_FILE PER_TEST_TIMEOUT TREE...: runs each exp tree's own copy of TEST_FILE (its
# tests/ when archived with it, else this checkout's), narrowed by AB_TEST_K / AB_TEST_ARGS;
# AB_TEST_ONLY_FIRST=1 tests the first tree only. Sets AB_PASSED to the trees whose tests passed; a
# tree whose tests fail or hang (cut by `timeout`: the call's own limit would take the whole lease)
# is left out. AB_SKIP_TESTS=1: no tests here (the caller ran them), every tree is timed.
ab_test_trees() {
  local file=$1 per_test=$2 tree own
  shift 2
  AB_PASSED=()
  if [ "${AB_SKIP_TESTS:-0}" = 1 ]; then AB_PASSED=("$@"); echo "== AB_SKIP_TESTS=1: the trees' tests ran before"; return 0; fi
  for tree in "$@"; do
    if [ "${AB_TEST_ONLY_FIRST:-0}" = 1 ] && [ ${#AB_PASSED[@]} -gt 0 ]; then AB_PASSED+=("$tree"); continue; fi
    own="$(dirname "$tree")/$file"; [ -f "$own" ] || own=$file
    echo "== $(ab_name_of "$tree"): $file $(date +%T)"
    # shellcheck disable=SC2086  # AB_TEST_ARGS is a list of arguments
    if PYTHONPATH=$tree:. timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout "$per_test" \
        "$own" ${AB_TEST_K:+-k "$AB_TEST_K"} ${AB_TEST_ARGS:-} 2>&1 | tail -3; then
      AB_PASSED+=("$tree")
    else
      echo "$(ab_name_of "$tree"): tests failed or hung, left out"
    fi
  done
  [ ${#AB_PASSED[@]} -gt 0 ]
}

# ab_summarize OUT PROVIDER: per row (head dim, tokens, mix, slots, mode), the median TFLOP/s of
# PROVIDER's records in OUT/ab-<tree>-<round>.json per tree, and exp/base.
ab_summarize() {
  python3 - "$1" "$2" <<'PY'
import collections, glob, json, os, statistics, sys
out, provider = sys.argv[1:3]
rows = collections.defaultdict(lambda: collections.defaultdict(list))  # tree -> row -> TFLOP/s
for path in glob.glob(f"{out}/ab-*-*.json"):
    tree = os.path.basename(path)[3:].rsplit("-", 1)[0]
    for r in json.load(open(path))["records"]:
        if r.get("provider") == provider and r.get("status") == "ok" and "tflops" in r:
            s = r["shape"]
            key = (s["head_dim"], s["tokens"], s["mix"], s.get("slot_multiple", 1), r.get("mode", "fwd"))
            rows[tree][key].append(r["tflops"])
base = rows.pop("base", {})
for key in sorted(base):
    b = statistics.median(base[key])
    cells = [f"{t} {statistics.median(v[key]):.1f} ({statistics.median(v[key]) / b:.3f})" for t, v in sorted(rows.items()) if key in v]
    print(f"D{key[0]} {key[1]} {key[2]} slots{key[3]} {key[4]}: base {b:.1f} | " + " | ".join(cells))
PY
}

# ab_pack OUT TARBALL [PREFIX]: the run files (PREFIX-*-*.json, default ab) into one tarball (the
# device returns a limited number of files).
ab_pack() {
  local prefix=${3:-ab}
  tar -czf "$1/$2" -C "$1" $(cd "$1" && ls "$prefix"-*-*.json) && (cd "$1" && rm -f "$prefix"-*-*.json)
}

# ab_rounds ROUNDS ROUND_S: ROUNDS alternating rounds over this checkout's src/ (base) and the trees
# in AB_PASSED, each process through the caller's `ab_bench SRC NAME ROUND`; no process starts with
# less than ROUND_S seconds of AB_BUDGET_S left.
ab_rounds() {
  local rounds=$1 round_s=$2 i src name
  for i in $(seq "$rounds"); do
    for src in src "${AB_PASSED[@]}"; do
      ab_has_time "$round_s" || { echo "AB_BUDGET_S reached: round $i stops before $src"; return 0; }
      name=base; [ "$src" = src ] || name=$(ab_name_of "$src")
      ab_bench "$src" "$name" "$i" || echo "$name round $i failed"
    done
  done
}
