#!/usr/bin/env bash
# Runs four real OpenAI clients against a running jspec server, as a new user would,
# in both chat and completions modes, and prints one PASS/FAIL line per client+mode.
#
#   scripts/clients/run_clients.sh BASE_URL LOGDIR [VENV]
#
#   BASE_URL  the server's OpenAI base, e.g. http://127.0.0.1:8011/v1 (a URL without
#             /v1 gets it added)
#   LOGDIR    where each client's full output goes (created; one .log per client+mode,
#             plus the clients' own result files)
#   VENV      a virtual environment holding the clients (default $CLIENTS_VENV, else
#             /work/clients-venv), made with:
#               python3 -m venv VENV && VENV/bin/pip install torch==2.13.0 &&
#               VENV/bin/pip install guidellm aiperf langchain-openai 'lm-eval[api]'
#
# Environment: MODEL (served model name, default jspec-bundled); TOKENIZER (a local
# tokenizer directory for the clients that count tokens, default the bundled target);
# ONLY (a subset of "guidellm aiperf langchain lm-eval"); CLIENT_TIMEOUT (seconds per
# client run, default 180).
#
# A client+mode FAILs on a non-zero exit (or timeout), on any 4xx/5xx it reports, or on
# empty results (guidellm/aiperf with no successful request or any errored one; lm-eval
# without its metric, or generation with every answer empty). Nothing is fetched from a
# model hub: the tokenizer is local and HF_HUB_OFFLINE=1 is set (not for aiperf, whose
# offline mode cannot load a tokenizer from a local path). Exit status: 0 when all pass.
set -u

if [ $# -lt 2 ]; then
    sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
fi
BASE=${1%/}
LOGDIR=$2
VENV=${3:-${CLIENTS_VENV:-/work/clients-venv}}
case $BASE in */v1) ;; *) BASE=$BASE/v1 ;; esac
ROOT=${BASE%/v1}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
MODEL=${MODEL:-jspec-bundled}
TOKENIZER=${TOKENIZER:-$REPO/jspec/bundle/target}
ONLY=${ONLY:-guidellm aiperf langchain lm-eval}
CLIENT_TIMEOUT=${CLIENT_TIMEOUT:-180}
PY=$VENV/bin/python
mkdir -p "$LOGDIR" && LOGDIR=$(cd "$LOGDIR" && pwd)

for tool in python guidellm aiperf lm_eval; do
    if [ ! -x "$VENV/bin/$tool" ]; then
        echo "FAIL setup: $VENV/bin/$tool is missing (see the usage above for the venv)"
        exit 2
    fi
done
server_up() {
    "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10).read()" \
        "$BASE/models" >/dev/null 2>&1
}
if ! server_up; then
    echo "FAIL setup: $BASE/models does not answer; start the server first"
    exit 2
fi

"$PY" -m pip list --format=freeze 2>/dev/null |
    grep -iE '^(guidellm|aiperf|langchain-openai|langchain-core|openai|lm.eval|transformers|torch|httpx|aiohttp)==' \
    >"$LOGDIR/versions.txt"

SUMMARY=()
report() {  # report LABEL VERDICT-LINE
    echo "$2"
    SUMMARY+=("$2")
}
wants() { case " $ONLY " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
run_logged() {  # run_logged LOG CMD... -> the command's exit status (124: timed out)
    local log=$1; shift
    echo "+ $*" >"$log"
    if ! server_up; then  # a server that died under an earlier client: don't wait out timeouts
        echo "server at $BASE/models no longer answers; not run" >>"$log"
        return 125
    fi
    timeout --kill-after=10 "$CLIENT_TIMEOUT" "$@" >>"$log" 2>&1
}

# ------------------------------------------------------------------ guidellm
guidellm_run() {  # guidellm_run MODE REQUEST_FORMAT
    local mode=$1 format=$2 log=$LOGDIR/guidellm-$1.log json=$LOGDIR/guidellm-$1.json rc
    rm -f "$json"
    HF_HUB_OFFLINE=1 run_logged "$log" "$VENV/bin/guidellm" run \
        --backend "kind=openai_http,target=$BASE,model=$MODEL,request_format=$format" \
        --tokenizer "kind=huggingface_auto,model=$TOKENIZER" \
        --data kind=synthetic_text,prompt_tokens=32,output_tokens=16 \
        --profile kind=concurrent,streams=2 \
        --constraint kind=max_requests,count=10 --constraint kind=max_duration,seconds=120 \
        --output "kind=json,path=$json" --disable-progress
    rc=$?
    report guidellm "$("$PY" - "$json" "$rc" "guidellm $mode" <<'EOF'
import json, re, sys
path, rc, label = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    bench = json.load(open(path))["benchmarks"][0]["requests"]
except Exception as err:  # noqa: BLE001
    print(f"FAIL {label}: exit {rc}, no results ({type(err).__name__}: {err})"[:400]); sys.exit()
ok, bad = len(bench.get("successful") or []), bench.get("errored") or []
first = str(bad[0].get("info", {}).get("error") or bad[0].get("error")) if bad else ""
first = re.sub(r"(\\n|\s)+For more information.*", "", first).replace("\\n", " ")
verdict = "PASS" if rc == 0 and ok > 0 and not bad else "FAIL"
print(f"{verdict} {label}: exit {rc}, {ok} successful, {len(bad)} errored"
      + (f"; first error: {first}" if first else "")[:400])
EOF
)"
}
if wants guidellm; then
    guidellm_run chat /v1/chat/completions
    guidellm_run completions /v1/completions
fi

# ------------------------------------------------------------------ aiperf
aiperf_run() {  # aiperf_run MODE ENDPOINT_TYPE
    local mode=$1 kind=$2 log=$LOGDIR/aiperf-$1.log dir=$LOGDIR/aiperf-$1 rc
    rm -rf "$dir"
    (unset HF_HUB_OFFLINE TRANSFORMERS_OFFLINE
     run_logged "$log" "$VENV/bin/aiperf" profile \
        --model "$MODEL" --url "$ROOT" --endpoint-type "$kind" --streaming \
        --tokenizer "$TOKENIZER" --synthetic-input-tokens-mean 32 --output-tokens-mean 16 \
        --request-count 10 --concurrency 2 --artifact-dir "$dir")
    rc=$?
    report aiperf "$("$PY" - "$dir" "$rc" "aiperf $mode" <<'EOF'
import json, os, sys
d, rc, label = sys.argv[1], int(sys.argv[2]), sys.argv[3]
errors, first = 0, ""
try:
    for line in open(os.path.join(d, "profile_export.jsonl")):
        err = json.loads(line).get("error")
        if err:
            errors += 1
            first = first or f"HTTP {err.get('code')} {err.get('message')}"
except OSError:
    pass
try:
    summary = json.load(open(os.path.join(d, "profile_export_aiperf.json")))
    done = int((summary.get("request_count") or {}).get("avg") or 0)
except Exception:  # noqa: BLE001
    done = 0
verdict = "PASS" if rc == 0 and done > 0 and errors == 0 else "FAIL"
print(f"{verdict} {label}: exit {rc}, {done} requests counted, {errors} errored"
      + (f"; first error: {first}" if first else "")[:400])
EOF
)"
}
if wants aiperf; then
    aiperf_run chat chat
    aiperf_run completions completions
fi

# ------------------------------------------------------------------ langchain-openai
if wants langchain; then
    for mode in completions chat; do
        log=$LOGDIR/langchain-$mode.log
        run_logged "$log" "$PY" "$HERE/langchain_check.py" "$BASE" "$mode"
        rc=$?
        fails=$(grep -c '^FAIL' "$log")
        passes=$(grep -c '^PASS' "$log")
        first=$(grep -m1 '^FAIL' "$log" | cut -c1-300)
        if [ "$rc" -eq 0 ] && [ "$fails" -eq 0 ] && [ "$passes" -gt 0 ]; then verdict=PASS; else verdict=FAIL; fi
        report langchain "$verdict langchain $mode: exit $rc, $passes calls passed, $fails failed${first:+; first: ${first#FAIL }}"
    done
fi

# ------------------------------------------------------------------ lm-eval
lmeval_run() {  # lmeval_run MODE TASK [lm_eval args...]
    local mode=$1 task=$2 log=$LOGDIR/lm-eval-$1.log out=$LOGDIR/lm-eval-$1 rc
    shift 2
    rm -rf "$out"
    # the tasks' data_files are relative paths: run from this folder
    (cd "$HERE" && HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
        run_logged "$log" "$VENV/bin/lm_eval" --tasks "$task" --include_path "$HERE" \
        --output_path "$out" --log_samples "$@")
    rc=$?
    report lm-eval "$("$PY" - "$out" "$rc" "lm-eval $mode" "$task" "$log" <<'EOF'
import glob, json, os, re, sys
out, rc, label, task, log = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
results = sorted(glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True))
samples = sorted(glob.glob(os.path.join(out, "**", f"samples_{task}_*.jsonl"), recursive=True))
metrics, answered, total = {}, 0, 0
if results:
    metrics = {k: v for k, v in json.load(open(results[-1]))["results"].get(task, {}).items()
               if isinstance(v, (int, float)) and "stderr" not in k}
if samples:
    for line in open(samples[-1]):
        s = json.loads(line)
        total += 1
        resps = s.get("filtered_resps") or s.get("resps") or []
        answered += any((r if isinstance(r, str) else str(r)).strip() for r in resps)
error = ""
if rc != 0:
    text = open(log, errors="replace").read()
    found = re.findall(r"API request failed[^\n]*", text) or re.findall(r"\n(\w+(?:\.\w+)*(?:Error|Exception)[^\n]*)", text)
    error = found[-1] if found else ""
generation = "gen" in task
ok = rc == 0 and bool(metrics) and (answered > 0 if generation else total > 0)
detail = ", ".join(f"{k}={v:.3g}" for k, v in metrics.items()) or "no metrics"
print(f"{'PASS' if ok else 'FAIL'} {label}: exit {rc}, {detail}, {answered}/{total} samples answered"
      + (f"; error: {error}" if error else "")[:400])
EOF
)"
}
if wants lm-eval; then
    LC="model=$MODEL,base_url=$BASE/completions,tokenizer=$TOKENIZER,tokenizer_backend=huggingface,max_retries=1"
    lmeval_run completions jspec_py_mc --model local-completions --model_args "$LC"
    lmeval_run completions-batch4 jspec_py_mc --model local-completions --model_args "$LC" --batch_size 4
    lmeval_run completions-generate jspec_py_gen --model local-completions --model_args "$LC"
    lmeval_run chat jspec_py_gen --model local-chat-completions \
        --model_args "model=$MODEL,base_url=$BASE/chat/completions,max_retries=1" --apply_chat_template
fi

echo
echo "== summary ($BASE; logs in $LOGDIR)"
status=0
for line in "${SUMMARY[@]}"; do
    echo "$line"
    case $line in PASS*) ;; *) status=1 ;; esac
done
exit $status
