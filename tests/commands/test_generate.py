"""`baton generate`: the one-line JSON contract, streaming, several prompts, errors, cheap imports."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
from baton.commands import generate
from baton.model import load_checkpoint
from baton.sampling.params import SamplingParams
from baton.sarathi import Engine
from cli_checkpoint import save_cli_checkpoint


def run_generate(argv: list[str]) -> int:
    """The command in-process (``baton.cli`` adds only its ValueError -> exit 2 wrapper)."""
    parser = argparse.ArgumentParser(prog="baton generate")
    generate.add_arguments(parser)
    return generate.run(parser.parse_args(argv))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_cli_checkpoint(tmp_path_factory.mktemp("cli-model"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    loaded = load_checkpoint(checkpoint, dtype="float32", device="cpu")
    engine = Engine(loaded.model, loaded.tokenizer)

    def generate(prompt, max_tokens: int):
        return engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]

    return generate


def test_json_contract_from_a_real_process(checkpoint, reference):
    completed = subprocess.run(
        [sys.executable, "-m", "baton.cli", "generate", "--model", str(checkpoint),
         "--prompt-ids", "1,2,3", "--max-tokens", "6", "--temperature", "0", "--json"],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    assert len(lines) == 1
    payload = json.loads(lines[0])
    assert list(payload) == ["token_ids", "text"]
    expected = reference([1, 2, 3], 6)
    assert payload == {"token_ids": expected.token_ids, "text": expected.text}
    assert len(payload["token_ids"]) == 6


def test_several_prompts_print_one_line_each_in_order(checkpoint, reference, capsys):
    code = run_generate(["--model", str(checkpoint), "def f(x):", "import os",
                 "--prompt-ids", "7,8", "--max-tokens", "5", "--temperature", "0", "--json"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = [reference(p, 5) for p in ("def f(x):", "import os", [7, 8])]
    assert lines == [{"token_ids": e.token_ids, "text": e.text} for e in expected]


def test_text_streams_to_the_terminal(checkpoint, reference, capsys):
    assert run_generate(["--model", str(checkpoint), "class A:", "--max-tokens", "8"]) == 0
    assert capsys.readouterr().out == reference("class A:", 8).text + "\n"


def test_stop_string_ends_the_text(checkpoint, reference, capsys):
    free_text = reference([5, 6, 7], 12).text
    stop = free_text[3:5]
    assert stop and free_text.find(stop) == 3
    run_generate(["--model", str(checkpoint), "--prompt-ids", "5,6,7", "--max-tokens", "12",
          "--stop", stop, "--json"])
    assert json.loads(capsys.readouterr().out)["text"] == free_text[:3]


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", "1,999"], "prompt token ids [999] are outside the vocabulary"),
    (["--prompt-ids", "1", "--temperature", "-1"], "temperature must be a finite number >= 0, got -1.0"),
    (["--prompt-ids", "1", "--scheduler-token-budget", "1"], "token_budget must be 0 (auto) or >= 2, got 1"),
    ([], "give at least one PROMPT or --prompt-ids"),
])
def test_bad_input_is_a_value_error_naming_the_value(checkpoint, argv, message):
    with pytest.raises(ValueError) as error:
        run_generate(["--model", str(checkpoint), *argv])
    assert message in str(error.value)


def test_a_missing_model_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match="nope"):
        run_generate(["--model", str(tmp_path / "nope"), "x"])


def test_the_command_module_imports_cheaply():
    code = "import sys, baton.commands.generate; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60, check=False).returncode == 0


@pytest.mark.slow
def test_chain_ranks_prefill_through_a_local_chain_then_decode_the_same(checkpoint, reference, capsys):
    prompt = list(range(1, 41))
    run_generate(["--model", str(checkpoint), "--prompt-ids", ",".join(map(str, prompt)),
                  "--max-tokens", "6", "--chain-ranks", "2", "--json"])
    expected = reference(prompt, 6)
    assert json.loads(capsys.readouterr().out) == {"token_ids": expected.token_ids, "text": expected.text}
