"""`python -m glmjax.prefill` on the tiny preset: the states it saves are the states of a cold
single pass after exactly p tokens, resuming from them gives a cold run's logits, explicit
checkpoint lists, and argument errors.

Block size 64 and budget 128, so a 350-token prompt takes three spans ([0, 128), [128, 256),
[256, 350) with a kernel checkpoint at 320). The oracle is the model's own jitted prefill over
the whole prompt in one span, its checkpoint offsets at the positions to check; every oracle
call shares one bucket (512 rows, 8 blocks) and every CLI run another, so the module compiles
the step twice.
"""

import dataclasses
import io

import jax.numpy as jnp
import numpy as np
import pytest

from glmjax.batch import PrefillBatch
from glmjax.caches import Caches
from glmjax.config import ModelConfig
from glmjax.model import prefill
from glmjax.prefill import load_states, main, random_model_state, read_prompt
from glmjax.state_pool import PoolStatus

CONFIG = dataclasses.replace(ModelConfig.preset("tiny"), kv_block_size=64)
GRID = ["--block-size", "64", "--budget", "128", "--no-compile-cache"]  # no disk writes in tests
SHORT = 350
ORACLE_ROWS, ORACLE_BLOCKS = 512, 8
LOGIT_RTOL = 2e-5  # max |diff| / max |reference logit|
STATE_TOL = dict(rtol=1e-4, atol=2e-5)


def random_prompt(length: int, seed: int = 0) -> np.ndarray:
    """The tokens `--random-tokens length --seed seed` draws."""
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, length).astype(np.int32)


@pytest.fixture(scope="module")
def model_state():
    return random_model_state(CONFIG, 0)  # the CLI's default weights (--seed 0)


def cold_run(model_state, tokens: np.ndarray, offsets=()):
    """One cold span over all of `tokens`: (last-token logits, {p: [(recurrent, conv)] per
    KDA layer}) for up to 4 positions p."""
    length = len(tokens)
    dests = list(range(1, len(offsets) + 1))
    batch = PrefillBatch(
        token_ids=jnp.asarray(np.pad(tokens, (0, ORACLE_ROWS - length)), jnp.int32),
        positions=jnp.asarray(np.pad(np.arange(length), (0, ORACLE_ROWS - length)), jnp.int32),
        cu_seqlens=jnp.array([0, length], jnp.int32),
        state_slots=jnp.array([0], jnp.int32),
        has_initial=jnp.array([False]),
        checkpoint_offsets=jnp.array([list(offsets) + [-1] * (4 - len(offsets))], jnp.int32),
        checkpoint_slots=jnp.array([dests + [-1] * (4 - len(dests))], jnp.int32),
        block_tables=jnp.arange(ORACLE_BLOCKS, dtype=jnp.int32)[None],
        prefix_lens=jnp.array([0], jnp.int32))
    out = prefill(model_state, Caches.init(CONFIG, 5, ORACLE_BLOCKS), batch)
    assert int(out.status) == PoolStatus.OK
    states = {p: [(np.asarray(pool.recurrent[slot]), np.asarray(pool.conv[slot]))
                  for pool in out.caches.kda] for p, slot in zip(offsets, dests)}
    return np.asarray(out.logits[0]), states


def assert_saved_states_match_cold(model_state, saved, tokens):
    """Every saved position against the oracle, four positions per oracle call; returns the
    largest absolute state difference and the oracle's last-token logits."""
    positions = list(saved.positions)
    worst = 0.0
    for first in range(0, len(positions), 4):
        logits, cold = cold_run(model_state, tokens, positions[first:first + 4])
        for p, layers in cold.items():
            row = positions.index(p)
            for layer, (rec, conv) in enumerate(layers):
                for name, got, want in (("recurrent", saved.recurrent[layer][row], rec),
                                        ("conv", saved.conv[layer][row], conv)):
                    np.testing.assert_allclose(got, want, **STATE_TOL,
                                               err_msg=f"{name} layer {layer} at {p}")
                    worst = max(worst, float(np.max(np.abs(got - want))))
    return worst, logits


def relative_logit_error(actual, reference) -> float:
    return float(np.max(np.abs(actual - reference)) / np.max(np.abs(reference)))


@pytest.fixture(scope="module")
def saved_short(tmp_path_factory):
    """The CLI run on 350 random tokens with the planner's checkpoints, states saved, and
    what its progress bar drew."""
    path = tmp_path_factory.mktemp("states") / "short"
    progress = io.StringIO()
    result = main(["--random-tokens", str(SHORT), *GRID, "--save-states", str(path)],
                  progress=progress)
    return path, result, progress.getvalue()


def test_saved_states_equal_cold_states_after_exactly_p_tokens(model_state, saved_short):
    path, result, _ = saved_short
    assert [(s.start, s.end, s.checkpoints) for s in result.spans] == [
        (0, 128, ()), (128, 256, ()), (256, 350, (320,))]
    assert result.retained == (128, 256, 320, 350)
    saved = load_states(path)
    assert saved.positions == (128, 256, 320, 350)
    worst, logits = assert_saved_states_match_cold(model_state, saved, random_prompt(SHORT))
    assert relative_logit_error(result.logits, logits) <= LOGIT_RTOL
    print(f"max |saved - cold| state {worst:.2e}")


def test_progress_bar_counts_tokens_and_spans(saved_short):
    assert f"{SHORT}/{SHORT} tokens, span 3/3" in saved_short[2]


def test_load_states_refuses_states_of_other_weights(saved_short):
    with pytest.raises(ValueError, match="other weights"):
        main(["--random-tokens", str(SHORT), *GRID, "--seed", "1", "--load-states",
              str(saved_short[0])], progress=None)


@pytest.mark.parametrize("diverge, expected_start", [(None, SHORT), (300, 256)])
def test_load_states_resumes_a_longer_prompt_like_a_cold_run(
        model_state, saved_short, tmp_path, diverge, expected_start):
    """A longer prompt sharing all 350 tokens resumes from the final state at 350; one that
    diverges at 300 resumes from the longest retained state whose prefix still matches."""
    prefix = random_prompt(SHORT)
    if diverge is not None:
        prefix = np.concatenate([prefix[:diverge], random_prompt(SHORT - diverge, seed=7)])
    tokens = np.concatenate([prefix, random_prompt(130, seed=5)])
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(map(str, tokens)))
    resumed_path = tmp_path / "resumed"
    result = main(["--prompt-file", str(prompt), *GRID, "--load-states", str(saved_short[0]),
                   "--save-states", str(resumed_path)], progress=None)
    assert result.resumed_from == expected_start
    assert result.spans[0].start == expected_start
    # States retained after the resume (and those inherited up to it) are cold states too.
    saved = load_states(resumed_path)
    assert expected_start in saved.positions and len(tokens) in saved.positions
    _, logits = assert_saved_states_match_cold(model_state, saved, tokens)
    error = relative_logit_error(result.logits, logits)
    assert error <= LOGIT_RTOL, f"max relative logit error {error:.2e}"
    print(f"resumed at {expected_start}: relative logit error {error:.2e}")


def test_explicit_checkpoints_more_than_four_in_a_span(model_state, tmp_path):
    path = tmp_path / "explicit"
    result = main(["--random-tokens", str(SHORT), *GRID, "--checkpoints",
                   "333,10,20,30,40,50,100,20", "--save-states", str(path)], progress=None)
    # [0, 128) holds six positions: it is split after four, at 50.
    assert [(s.start, s.end, s.checkpoints, s.retain_end) for s in result.spans] == [
        (0, 50, (10, 20, 30, 40), True), (50, 128, (100,), False),
        (128, 256, (), False), (256, 350, (333,), False)]
    saved = load_states(path)
    assert saved.positions == (10, 20, 30, 40, 50, 100, 333, SHORT)
    assert_saved_states_match_cold(model_state, saved, random_prompt(SHORT))


@pytest.mark.parametrize("checkpoints, named", [
    ("351", "351"), ("0", "0"), ("100,abc", "'abc'"), ("1.5", "'1.5'"), ("-3", "-3")])
def test_bad_checkpoints_name_the_value(checkpoints, named):
    with pytest.raises(ValueError, match=f"--checkpoints: .*{named}"):
        main(["--random-tokens", str(SHORT), *GRID, "--checkpoints", checkpoints],
             progress=None)


def test_bad_prompt_file_names_the_token(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("1 2 x3 4")
    with pytest.raises(ValueError, match="'x3'"):
        main(["--prompt-file", str(prompt), *GRID], progress=None)
    prompt.write_text("1 2 5000")
    with pytest.raises(ValueError, match="5000"):
        main(["--prompt-file", str(prompt), *GRID], progress=None)


def test_prompt_file_as_bytes_and_as_integers(tmp_path):
    prompt = tmp_path / "prompt.bin"
    prompt.write_bytes(b"ab\xff 7")
    np.testing.assert_array_equal(read_prompt(prompt, as_bytes=True, vocab_size=1024),
                                  [97, 98, 255, 32, 55])
    prompt.write_text(" 3\n 1023\t0 ")
    np.testing.assert_array_equal(read_prompt(prompt, as_bytes=False, vocab_size=1024),
                                  [3, 1023, 0])
    prompt.write_text("  ")
    with pytest.raises(ValueError, match="empty"):
        read_prompt(prompt, as_bytes=False, vocab_size=1024)


# --- on a mesh ------------------------------------------------------------------------------

# max |mesh - one device| / max |one device| of each array (logits, each layer's state at
# each position, each MLA layer's latents). Both are fp32 evaluations of the same model
# summed in different orders, and each is up to 1.2e-6 from an fp64 evaluation (README,
# "Four processes"): their difference is bounded by the sum, ~2.4e-6, not by 1e-6.
MESH_TOLERANCE = 2e-6
MESH = ["--tp", "4", "--dcp", "2"]  # a (2, 2) mesh of the host devices conftest asks for


def token_rows(blocks: np.ndarray, length: int) -> np.ndarray:
    """Saved latent blocks [M, P, D] -> the first `length` tokens' rows [length, D]."""
    return blocks.reshape(-1, blocks.shape[-1])[:length]


@pytest.fixture(scope="module")
def saved_mesh(tmp_path_factory):
    path = tmp_path_factory.mktemp("states") / "mesh"
    result = main(["--random-tokens", str(SHORT), *GRID, *MESH, "--save-states", str(path)],
                  progress=None)
    return path, result


def test_mesh_prefill_equals_one_device(saved_short, saved_mesh):
    """The logits, every saved KDA state (recurrent and conv, every layer and position) and
    the MLA latents (token order) of the mesh against one device (dcp 1)."""
    (one_path, one, _), (mesh_path, mesh) = saved_short, saved_mesh
    assert mesh.spans == one.spans
    want, got = load_states(one_path), load_states(mesh_path)
    assert got.positions == want.positions
    errors = {"logits": relative_logit_error(mesh.logits, one.logits)}
    for layer in range(len(want.recurrent)):
        for row, p in enumerate(want.positions):
            for kind in ("recurrent", "conv"):
                errors[f"{kind} {layer} @ {p}"] = relative_logit_error(
                    getattr(got, kind)[layer][row], getattr(want, kind)[layer][row])
    for layer, (g, w) in enumerate(zip(got.mla, want.mla, strict=True)):
        errors[f"mla latent {layer}"] = relative_logit_error(token_rows(g["latent"], SHORT),
                                                             token_rows(w["latent"], SHORT))
    worst = max(errors, key=errors.get)
    print(f"mesh vs one device: worst {worst} {errors[worst]:.2e}, logits {errors['logits']:.2e}")
    for name, error in errors.items():
        assert error <= MESH_TOLERANCE, f"{name}: max relative difference {error:.2e}"


@pytest.mark.extended  # ~24 s of CI's cores; resuming on one device: above
def test_mesh_resumes_from_its_states_like_a_cold_run(model_state, saved_mesh, tmp_path):
    """A longer prompt resumed on the mesh from the mesh's states (the MLA latents put back
    in the mesh's DCP layout): the one-device cold run's logits."""
    tokens = np.concatenate([random_prompt(SHORT), random_prompt(130, seed=5)])
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(map(str, tokens)))
    result = main(["--prompt-file", str(prompt), *GRID, *MESH, "--load-states",
                   str(saved_mesh[0])], progress=None)
    assert result.resumed_from == SHORT
    logits, _ = cold_run(model_state, tokens)
    error = relative_logit_error(result.logits, logits)
    assert error <= LOGIT_RTOL, f"max relative logit error {error:.2e}"


@pytest.mark.parametrize("mesh, message", [
    (["--tp", "0"], "--tp must be >= 1, got 0"),
    (["--tp", "3", "--dcp", "2"], "dcp=2 must divide tp=3"),
    (["--tp", "16"], "tp=16 needs 16 devices"),
])
def test_bad_meshes_name_the_value(mesh, message):
    with pytest.raises(ValueError, match=message):
        main(["--random-tokens", str(SHORT), *GRID, *mesh], progress=None)
