"""The replay model provider (cortex_worker.llm.replay) and the demo transcript."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from cortex_worker.llm import gateway
from cortex_worker.llm import replay as replay_module
from cortex_worker.llm.config import ModelConfig
from cortex_worker.llm.replay import replay_stream
from cortex_worker.llm.stream import ModelError, TextDelta, Usage
from cortex_worker.protocol.document import load_document

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "transcripts" / "research.yaml"
TURNS = ["<thought>first turn</thought>", "<response final=\"true\">second</response>"]


def write_transcript(directory: Path, name: str = "t.yaml", turns: Any = None) -> Path:
    path = directory / name
    data = {"turns": TURNS if turns is None else turns}
    path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    return path


def replay(transcript: str, **overrides: Any) -> ModelConfig:
    return ModelConfig(provider="replay", transcript=transcript,
                       **{"tokens_per_second": 1000.0, **overrides})


def text(pieces: list[Any]) -> str:
    return "".join(piece.text for piece in pieces if isinstance(piece, TextDelta))


def conversation(assistant_turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "protocol"}, {"role": "user", "content": "go"}]
    for n in range(assistant_turns):
        messages += [{"role": "assistant", "content": f"turn {n + 1}"},
                     {"role": "user", "content": "<result id=\"x\" status=\"ok\">1</result>"}]
    return messages


def test_the_turn_is_the_number_of_assistant_messages(tmp_path: Path) -> None:
    config = replay(str(write_transcript(tmp_path)))
    assert text(list(replay_stream(config, conversation(0)))) == TURNS[0]
    assert text(list(replay_stream(config, conversation(1)))) == TURNS[1]


def test_past_the_last_turn_is_a_clear_error(tmp_path: Path) -> None:
    config = replay(str(write_transcript(tmp_path)))
    with pytest.raises(ModelError, match="has only 2 turns") as info:
        list(replay_stream(config, conversation(2)))
    assert not info.value.retryable


def test_pieces_are_four_characters_and_usage_is_estimated(tmp_path: Path) -> None:
    config = replay(str(write_transcript(tmp_path, turns=["x" * 41])))
    pieces = list(replay_stream(config, [{"role": "user", "content": "y" * 40}]))
    deltas = [piece.text for piece in pieces if isinstance(piece, TextDelta)]
    assert [len(d) for d in deltas] == [4] * 10 + [1]
    assert pieces[-1] == Usage(prompt_tokens=10, completion_tokens=11, total_tokens=21)


class FakeClock:
    """The replay module's clock and sleep: sleeping moves the clock, and each token's
    consumer may take `work` seconds, so the schedule is checked without the machine's."""

    def __init__(self, work: float = 0.0) -> None:
        self.now, self.work = 100.0, work
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock(work=0.003)
    monkeypatch.setattr(replay_module, "time", SimpleNamespace(monotonic=fake.monotonic))
    monkeypatch.setattr(replay_module, "_sleep", fake.sleep)
    return fake


def test_the_token_rate_is_respected_on_a_schedule_that_does_not_drift(
        tmp_path: Path, clock: FakeClock) -> None:
    config = replay(str(write_transcript(tmp_path, turns=["abcd" * 21])), tokens_per_second=100)
    start = clock.now
    times = []
    for piece in replay_stream(config, []):
        if isinstance(piece, TextDelta):
            times.append(clock.now - start)
            clock.now += clock.work  # the consumer's own time counts against the next interval
    assert len(times) == 21
    assert times[0] == 0  # the first token at once
    # 20 intervals of 10 ms, each sleep shortened by the consumer's 3 ms: no drift
    assert times == pytest.approx([n * 0.01 for n in range(21)])
    assert clock.sleeps == pytest.approx([0.007] * 20)


def test_paths_resolve_from_the_cwd_or_the_base_dir(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    write_transcript(manifests, "demo.json")
    monkeypatch.chdir(tmp_path)
    config = replay("demo.json")
    assert text(list(replay_stream(config, [], base_dir=manifests))) == TURNS[0]
    assert text(list(replay_stream(replay("manifests/demo.json"), []))) == TURNS[0]
    with pytest.raises(ModelError, match="not found"):
        list(replay_stream(config, []))


@pytest.mark.parametrize(("content", "message"), [
    ("turns: [1, 2]", "turn 1 must be a string"),
    ("turns: []", "non-empty list 'turns'"),
    ("turns: [unclosed", "not valid YAML"),
])
def test_bad_transcripts_say_what_to_fix(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(ModelError, match=message):
        list(replay_stream(replay(str(path)), []))


def test_a_replay_config_without_transcript_is_an_error() -> None:
    with pytest.raises(ModelError, match="needs `transcript:`"):
        list(replay_stream(ModelConfig(provider="replay"), []))


def test_gateway_dispatches_to_replay(tmp_path: Path) -> None:
    config = replay(str(write_transcript(tmp_path)))
    assert text(list(gateway.open_stream(config, conversation(1)))) == TURNS[1]
    answer, usage = gateway.complete(config, conversation(0))
    assert answer == TURNS[0] and usage is not None


def test_the_stream_can_be_closed_early(tmp_path: Path, clock: FakeClock) -> None:
    """Closing the stream between tokens ends it there: no sleep towards the next token."""
    config = replay(str(write_transcript(tmp_path, turns=["z" * 4000])), tokens_per_second=20)
    gen = replay_stream(config, [])
    next(gen)
    gen.close()
    assert clock.sleeps == []
    with pytest.raises(StopIteration):
        next(gen)


def test_the_demo_transcript_is_valid_protocol() -> None:
    turns = yaml.safe_load(EXAMPLE.read_text())["turns"]
    assert len(turns) == 2
    first = load_document(turns[0])
    assert first.ok and not first.warnings
    async_in_thought = [a for a in first.actions if a.in_thought and a.mode.value == "async"]
    assert len(async_in_thought) >= 3
    assert [r["final"] for r in first.responses] == [False]
    second = load_document(turns[1], known=[a.id for a in first.actions])
    assert second.ok and not second.warnings
    assert [r["final"] for r in second.responses] == [True]
    assert "$calc_5" in second.responses[0]["text"]
    assert {a.name for a in first.actions + second.actions} <= {
        "echo", "calculator", "python", "write_file", "read_file", "grep", "sleep"}
    config = replay(str(EXAMPLE), tokens_per_second=1e6)
    assert text(list(replay_stream(config, conversation(1)))) == turns[1]
