"""A workflow's steps drawn as a graph (ADR 0020): each step a box in the column of its depth
(the longest chain of steps it waits for), an arrow from each step it waits for. The drawing is
SVG markup with escaped text; the page styles it by class, never by inline style."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ql3.application.queries import StepView

BOX_W, BOX_H, GAP_X, GAP_Y, PAD = 170, 44, 60, 20, 10


@dataclass(frozen=True, slots=True)
class Box:
    step_id: str
    task: str
    status: str
    run_id: str | None
    x: int
    y: int


@dataclass(frozen=True, slots=True)
class Edge:
    x1: int
    y1: int
    x2: int
    y2: int


@dataclass(frozen=True, slots=True)
class Graph:
    width: int
    height: int
    boxes: tuple[Box, ...]
    edges: tuple[Edge, ...]


def workflow_graph(steps: Sequence[StepView]) -> Graph:
    by_id = {view.step.step_id: view for view in steps}
    depth: dict[str, int] = {}

    def depth_of(step_id: str, seen: frozenset[str] = frozenset()) -> int:
        if step_id in depth:
            return depth[step_id]
        view = by_id.get(step_id)
        if view is None or step_id in seen:
            return 0
        after = [a for a in view.step.after if a in by_id]
        found = 1 + max((depth_of(a, seen | {step_id}) for a in after), default=-1)
        depth[step_id] = found
        return found

    columns: dict[int, list[StepView]] = {}
    for view in steps:
        columns.setdefault(depth_of(view.step.step_id), []).append(view)
    place: dict[str, tuple[int, int]] = {}
    boxes = []
    for column, views in sorted(columns.items()):
        for row, view in enumerate(views):
            x = PAD + column * (BOX_W + GAP_X)
            y = PAD + row * (BOX_H + GAP_Y)
            place[view.step.step_id] = (x, y)
            status = view.run.status.value if view.run is not None else view.step.status.value
            boxes.append(
                Box(view.step.step_id, view.step.task, status, view.step.run_id, x, y)
            )
    edges = []
    for view in steps:
        x2, y2 = place[view.step.step_id]
        for after in view.step.after:
            if after in place:
                x1, y1 = place[after]
                edges.append(Edge(x1 + BOX_W, y1 + BOX_H // 2, x2, y2 + BOX_H // 2))
    width = PAD * 2 + (max(columns, default=0) + 1) * (BOX_W + GAP_X) - GAP_X
    rows = max((len(v) for v in columns.values()), default=1)
    height = PAD * 2 + rows * (BOX_H + GAP_Y) - GAP_Y
    return Graph(width, height, tuple(boxes), tuple(edges))
