"""The flags of the tiny-preset servers the CPU tests start (test_server,
test_server_hardening, test_load, test_fuzz, test_tokenizer): one batch shape, a small
pool. One set for all of them, so that every start after the first reads the compiled
programs from the run's persistent compilation cache (``tests/conftest.py`` gives the run
one folder) instead of compiling them again: a cold start costs ~40 s of CPU, a warm one
~10. (test_server_hardening builds its server in the test process, which keeps no
persistent cache: it compiles the same programs in memory.)"""

MAX_MODEL_LEN = 512
TINY_SERVER_ARGS = [
    "--preset", "tiny",
    "--block-size", "64",
    "--max-num-batched-tokens", "128",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--single-bucket",
    "--max-num-seqs", "4",
    "--num-kv-blocks", "48",
    "--num-state-slots", "32",
    "--log-level", "warning",
]  # fmt: skip
