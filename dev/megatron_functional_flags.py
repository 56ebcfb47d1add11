#!/usr/bin/env python3
"""Writes dev/data/megatron_scripts/functional_test_flags.txt: every flag of Megatron-LM's GPT
functional-test configurations that run pretraining (tests/functional_tests/test_cases/gpt/*/
model_config.yaml, MODEL_ARGS; the MODE: inference and MODE: rl cases run other entry points and are
left out), each with the answer train_gpt gives it (from train_gpt_flags.h's table: implemented,
informational, refused), how many configurations use it, one of them, and its most common value.

  python3 dev/megatron_functional_flags.py --megatron /path/to/Megatron-LM [--out FILE]

The Megatron-LM path may be a checkout or a bare git directory (its HEAD is read). tests/test_flags.h
(flags_functional_test_flags_answered) reads the file back: every flag must be in the table with the
answer written here, and parse with its value.
"""
import argparse
import collections
import os
import re
import subprocess
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# Flags another change implements on the GPU side (their table rows come with it).
KINDS = {
    "F_INT": "implemented", "F_INT64": "implemented", "F_INT64_3": "implemented", "F_DOUBLE": "implemented",
    "F_STRING": "implemented", "F_TRUE": "implemented", "F_INFO_SWITCH": "informational",
    "F_INFO_VALUE": "informational", "F_REFUSED_SWITCH": "refused", "F_REFUSED_VALUE": "refused",
}


def git(megatron, *args):
    d = os.path.join(megatron, ".git") if os.path.isdir(os.path.join(megatron, ".git")) else megatron
    return subprocess.check_output(["git", "--git-dir=" + d] + list(args), text=True)


def table_answers():
    text = open(os.path.join(REPO, "train_gpt_flags.h")).read()
    return {m.group(1): KINDS[m.group(2)] for m in re.finditer(r'\{"(--[^"]+)", G_\w+, (F_\w+),', text)}


def command_value(v):
    """The value as it reaches the command line (the harness passes true as a bare switch)."""
    if v is True:
        return ""
    if isinstance(v, list):
        return " ".join(str(x) for x in v)
    return str(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron", required=True, help="a Megatron-LM checkout or git directory")
    ap.add_argument("--out", default=os.path.join(REPO, "dev/data/megatron_scripts/functional_test_flags.txt"))
    a = ap.parse_args()
    commit = git(a.megatron, "rev-parse", "HEAD").strip()
    files = sorted(f for f in git(a.megatron, "ls-tree", "-r", "HEAD", "--name-only").split("\n")
                   if f.startswith("tests/functional_tests/test_cases/gpt/") and f.endswith("/model_config.yaml"))
    uses = collections.OrderedDict()
    modes = collections.Counter()
    for f in files:
        d = yaml.safe_load(git(a.megatron, "show", "HEAD:" + f))
        mode = d.get("MODE", "pretraining")
        modes[mode] += 1
        if mode != "pretraining":
            continue
        for k, v in (d.get("MODEL_ARGS") or {}).items():
            if k.startswith("--") and v is not False:  # false: the harness leaves the switch out
                uses.setdefault(k, []).append((f.split("/")[4], command_value(v)))
    answers = table_answers()
    lines = [
        "# The flags of Megatron-LM's GPT functional-test configurations that run pretraining, with train_gpt's",
        f"# answer to each. Megatron-LM commit {commit}: tests/functional_tests/test_cases/gpt/*/model_config.yaml,",
        f"# MODEL_ARGS of the {modes['pretraining']} pretraining cases (the {sum(modes.values()) - modes['pretraining']} "
        "MODE: inference / rl cases run other entry points).",
        "# Written by dev/megatron_functional_flags.py; checked by tests/test_flags.h (every flag in the table with",
        "# this answer; each parses with its value, and one this build cannot honour is refused in one line",
        "# naming it). Answers: implemented, informational (accepted, no effect in this build), refused (one line:",
        "# why and what instead).",
        "# Columns, tab-separated: flag, answer, configurations using it, one of them, its most common value",
        "# (empty: a switch).",
    ]
    missing = []
    for flag, us in sorted(uses.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        answer = answers.get(flag)
        if answer is None:
            missing.append(flag)
            answer = "UNKNOWN"
        value = collections.Counter(v for _, v in us).most_common(1)[0][0]
        lines.append("\t".join([flag, answer, str(len(us)), us[0][0], value]))
    with open(a.out, "w") as out:
        out.write("\n".join(lines) + "\n")
    print(f"{len(uses)} flags from {modes['pretraining']} configurations -> {a.out}")
    if missing:
        print("not in the flag table: " + " ".join(missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
