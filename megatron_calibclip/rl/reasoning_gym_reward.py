"""Adapter from a model completion to reasoning-gym's own scorers (package `reasoning-gym`).

Why an adapter and not our verifier: each reasoning-gym task (chain_sum, word puzzles,
graph tasks, ...) defines what a correct answer is in ``dataset.score_answer(answer,
entry) -> float in [0, 1]``; re-implementing 100 scorers would drift. What the tasks
leave to us is getting the answer string out of a free-form completion: reasoning-gym's
prompts ask for ``<answer>...</answer>``; math-style prompts ask for \\boxed{}.

reasoning-gym is imported lazily (it pulls matplotlib & co. and takes ~1 s), so the rest
of rl/ works without it. API used (checked on reasoning-gym 0.1.25):
``reasoning_gym.create_dataset(name, size=, seed=)``, ``dataset.score_answer(answer,
entry)``, ``reasoning_gym.get_score_answer_fn(name)``, ``reasoning_gym.utils.extract_answer``,
entries are dicts with ``question``, ``answer`` and ``metadata['source_dataset']``.
"""
from __future__ import annotations

from typing import Any, Callable, Literal, Mapping

from megatron_calibclip.rl.rewards import extract_boxed, extract_final_answer, format_reward

Extraction = Literal["answer_tag", "boxed", "final_answer", "raw"]


def _import_reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "ReasoningGymReward needs the `reasoning-gym` package: pip install reasoning-gym"
        ) from err
    return reasoning_gym


def extract_tagged_answer(text: str, tag: str = "answer") -> str | None:
    """Content of the last <tag>...</tag> (reasoning-gym's own extractor), stripped."""
    rg = _import_reasoning_gym()
    return rg.utils.extract_answer(text, tag_name=tag)


class ReasoningGymReward:
    """Callable ``(completion, entry) -> reward`` that defers correctness to reasoning-gym.

    dataset: a reasoning-gym dataset whose ``score_answer`` is used for every entry; if
        None, the scorer is looked up (and cached) from ``entry['metadata']
        ['source_dataset']``, which also works for composite datasets.
    extraction: "answer_tag" (<answer>...</answer>, reasoning-gym's default prompt),
        "boxed" (\\boxed{}), "final_answer" (our math extractor: boxed, ####, last
        number) or "raw" (the whole completion). A completion without an extractable
        answer scores ``missing_reward`` (score_answer(None) is 0 in reasoning-gym).
    correct_reward / wrong_reward: the score s in [0, 1] is mapped to
        wrong + s * (correct - wrong) (DAPO: -1 / +1).
    format_weight: adds format_weight * 1[answer tag / box present].
    """

    def __init__(
        self,
        dataset: Any | None = None,
        *,
        extraction: Extraction = "answer_tag",
        correct_reward: float = 1.0,
        wrong_reward: float = 0.0,
        missing_reward: float | None = None,
        format_weight: float = 0.0,
    ):
        if extraction not in ("answer_tag", "boxed", "final_answer", "raw"):
            raise ValueError(
                f"extraction={extraction!r} is not one of ['answer_tag', 'boxed', 'final_answer', 'raw']"
            )
        if dataset is not None and not callable(getattr(dataset, "score_answer", None)):
            raise ValueError("dataset must have a score_answer(answer, entry) method")
        self.dataset = dataset
        self.extraction = extraction
        self.correct_reward = float(correct_reward)
        self.wrong_reward = float(wrong_reward)
        self.missing_reward = self.wrong_reward if missing_reward is None else float(missing_reward)
        self.format_weight = float(format_weight)
        self._scorers: dict[str, Callable[[str | None, Mapping[str, Any]], float]] = {}

    def extract(self, completion: str) -> str | None:
        if self.extraction == "answer_tag":
            return extract_tagged_answer(completion)
        if self.extraction == "boxed":
            return extract_boxed(completion)
        if self.extraction == "final_answer":
            return extract_final_answer(completion)
        return completion.strip()

    def _scorer(self, entry: Mapping[str, Any]) -> Callable[[str | None, Mapping[str, Any]], float]:
        if self.dataset is not None:
            return self.dataset.score_answer
        try:
            name = entry["metadata"]["source_dataset"]
        except (KeyError, TypeError) as err:
            raise ValueError(
                "entry has no metadata['source_dataset']; pass dataset= to ReasoningGymReward"
            ) from err
        if name not in self._scorers:
            self._scorers[name] = _import_reasoning_gym().get_score_answer_fn(name)
        return self._scorers[name]

    def score(self, completion: str, entry: Mapping[str, Any]) -> float | None:
        """reasoning-gym's score in [0, 1] for the extracted answer; None if no answer."""
        answer = self.extract(completion)
        if answer is None:
            return None
        return float(self._scorer(entry)(answer, entry))

    def __call__(self, completion: str, entry: Mapping[str, Any]) -> float:
        s = self.score(completion, entry)
        if s is None:
            reward = self.missing_reward
        else:
            reward = self.wrong_reward + s * (self.correct_reward - self.wrong_reward)
        if self.format_weight:
            if self.extraction in ("answer_tag", "raw"):
                fmt = format_reward(completion, style="answer_tag")
            else:
                fmt = format_reward(completion, style="boxed")
            reward += self.format_weight * fmt
        return float(reward)
