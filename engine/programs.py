"""Forward programs: model work written as generators that yield the forwards they need.

A *program* (drafting a tree, feeding a prompt, verifying a tree) is a generator that yields a
``Forward`` each time it needs a model's logits and receives them back; its return value is its
result. Who runs the forwards is not the program's business:

* ``run_alone`` runs each forward as it comes (one request, no batching: ``specinfer generate``);
* ``drive`` hands each forward to a function (a thread-gathering batcher);
* ``run_round`` / ``run_rounds`` advance many programs together: each round runs one batch per
  runner over every waiting program's item (``engine.loop``: one packed SSM forward per tree level
  for the whole batch, one packed target pass per iteration), with no threads and no clocks.

A ``Forward`` names its ``runner``: the object whose ``forward(items)`` runs a batch of such
items and returns, per item, its logits or its own error (``engine.packed.PackedModel``). Models
without a packed forward yield ``alone(call)``: a zero-argument callable run by ``ALONE``.

Example: a program ``p`` that yields ``Forward(m, a)`` then ``Forward(m, b)`` and returns the sum
of its two results, and a program ``q`` that yields ``Forward(m, c)`` once: ``run_rounds`` over
both runs ``m.forward([a, c])``, then ``m.forward([b])``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator, Protocol, Sequence


class Runner(Protocol):
    """Runs a batch of forward items: per item its result, or the error of that item alone."""

    def forward(self, items: list) -> list[Any | BaseException]: ...


@dataclass(frozen=True)
class Forward:
    """One forward a program waits for: ``item`` runs with the other waiting items of ``runner``."""

    runner: Runner
    item: object


Program = Generator[Forward, Any, Any]  # yields Forwards, receives each one's result, returns its own


class Alone:
    """The runner of models without a packed forward: each item is a callable, run by itself."""

    def forward(self, items: list[Callable[[], Any]]) -> list[Any | BaseException]:
        results = []
        for call in items:
            try:
                results.append(call())
            except Exception as error:  # the item's own failure
                results.append(error)
        return results


ALONE = Alone()


def alone(call: Callable[[], Any]) -> Forward:
    """A forward that runs by itself (``call()`` gives its result)."""
    return Forward(ALONE, call)


def drive(program: Program, submit: Callable[[Forward], Any]):
    """Run ``program`` to its result, ``submit`` giving each forward's result (or raising)."""
    try:
        forward = next(program)
        while True:
            try:
                result = submit(forward)
            except BaseException as error:
                forward = program.throw(error)
            else:
                forward = program.send(result)
    except StopIteration as done:
        return done.value


def submit_alone(forward: Forward):
    """A forward's result from its runner alone; its error raised."""
    (result,) = forward.runner.forward([forward.item])
    if isinstance(result, BaseException):
        raise result
    return result


def run_alone(program: Program):
    """Run ``program`` with each forward run by itself: one request's path."""
    return drive(program, submit_alone)


@dataclass
class Running:
    """A program under way: the forward it waits for (None once it ended), then its result or error."""

    program: Program
    waiting: Forward | None = None
    result: Any = None
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.waiting is None

    def advance(self, value: Any = None, error: BaseException | None = None) -> None:
        """Send the last forward's result (or throw its error) into the program; record what follows."""
        try:
            self.waiting = self.program.throw(error) if error is not None else self.program.send(value)
        except StopIteration as finished:
            self.waiting, self.result = None, finished.value
        except Exception as failed:  # the program's own failure ends it, not the others
            self.waiting, self.error = None, failed


def start(program: Program) -> Running:
    """A program advanced to its first forward (or its end)."""
    running = Running(program)
    running.advance()
    return running


def run_round(programs: Sequence[Running], chosen: Callable[[Running], bool] = lambda running: True) -> int:
    """One round: for each runner, one batch over the waiting programs' items (those ``chosen``);
    each program gets its result or its item's error. Returns the number of batches run.

    A runner's failure as a whole (it raised) fails every program of that batch."""
    batches: dict[int, tuple[Runner, list[Running]]] = {}
    for running in programs:
        if not running.done and chosen(running):
            batches.setdefault(id(running.waiting.runner), (running.waiting.runner, []))[1].append(running)
    for runner, members in batches.values():
        try:
            results = runner.forward([running.waiting.item for running in members])
        except Exception as error:
            results = [error] * len(members)
        for running, result in zip(members, results, strict=True):
            if isinstance(result, BaseException):
                running.advance(error=result)
            else:
                running.advance(result)
    return len(batches)


def run_rounds(programs: Sequence[Running]) -> int:
    """Rounds until every program ended; returns the rounds run (one forward per runner each)."""
    rounds = 0
    while any(not running.done for running in programs):
        run_round(programs)
        rounds += 1
    return rounds
