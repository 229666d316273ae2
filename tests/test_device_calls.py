"""bench/device_calls.sh, the pending H200 runs: every `python3 -m bench.X ...` command in it
goes through that module's own argument parser (stopped right after parsing), and every
test file it names exists, so a renamed flag or file fails here rather than on the device,
where a session has 30 minutes."""

import argparse
import importlib
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "bench" / "device_calls.sh"


def script_lines() -> list[str]:
    """The script's commands, continuation lines joined, $OUT as /out, ${NAME:-default}
    as its default (a caller's extra arguments, such as DECODE_ARGS, are not known here)."""
    text = SCRIPT.read_text().replace("\\\n", " ").replace("$OUT", "/out")
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text).splitlines()


def bench_runs() -> list[tuple[str, list[str]]]:
    runs = []
    for line in script_lines():
        if match := re.search(r"python3 -m\s+(bench\.\w+)(.*)", line):
            argv = shlex.split(match.group(2).split(")")[0])  # a subshell's ")" ends it
            runs.append((match.group(1), argv))
    return runs


class Parsed(Exception):
    """Raised in place of running the benchmark once its arguments parsed."""


def test_the_script_runs_benchmarks():
    modules = {module for module, _ in bench_runs()}
    assert {"bench.model_prefill", "bench.kda_kernel", "bench.decode",
            "bench.dsa_schedule"} <= modules


@pytest.mark.parametrize("module, argv", bench_runs(),
                         ids=[f"{m}-{i}" for i, (m, _) in enumerate(bench_runs())])
def test_each_benchmark_run_parses(monkeypatch, module, argv):
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)  # an unknown flag or a bad value exits here
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [module, *argv])
    with pytest.raises(Parsed):
        importlib.import_module(module).main()


def test_every_test_file_named_exists():
    named = {word.rstrip(")") for line in script_lines() for word in line.split()
             if word.startswith("tests/test_")}
    assert named, "the script names no test files"
    for path in named:
        assert (ROOT / path).is_file(), path
