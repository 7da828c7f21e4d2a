"""Which ranks of `qwenft plan` share one built rank's model parts (qwenft.train.plan.predict).

The ranks of one pipeline stage build the same modules and differ only in which rows of each sharded parameter
they hold; a rank whose every shard has the shape of a built rank's is planned from that rank's parts.
"""

from dataclasses import dataclass, field

import torch


class MeshCoords:
    """Any rank's coordinate in the same-shaped group of a sub-mesh of one rank's mesh: rank r's group of a mesh
    spans the same dims of the root mesh (pp, dp[_outer], cp, [ep,] tp) as this rank's, so r's coordinate in it is
    the place, in this rank's group, of the rank with r's root coordinates on those dims."""

    def __init__(self, root: torch.Tensor):
        self.root = root  # every rank, placed in the root mesh
        self.at = {int(r): tuple(int(i) for i in (root == r).nonzero()[0]) for r in root.flatten()}
        self.meshes: dict = {}  # id(mesh) -> (root dims it spans, {rank's coordinates on them: its place in it})

    def add(self, mesh) -> None:
        """Take in `mesh` (inside the process group its ranks' tensor needs)."""
        key = id(mesh)
        if key not in self.meshes:
            ranks = mesh.mesh
            places = [tuple(int(i) for i in (ranks == r).nonzero()[0]) for r in ranks.flatten()]
            dims = [d for d in range(self.root.ndim) if len({self.at[int(r)][d] for r in ranks.flatten()}) > 1]
            self.meshes[key] = dims, {tuple(self.at[int(r)][d] for d in dims): list(place)
                                      for r, place in zip(ranks.flatten(), places)}

    def of(self, mesh, rank: int) -> list[int] | None:
        """`rank`'s coordinate in its group of `mesh` (taken in with `add`), or None where it has none."""
        dims, places = self.meshes[id(mesh)]
        return places.get(tuple(self.at[rank][d] for d in dims))


@dataclass
class StageShare:
    """One built rank's model parts and parameters, planned for every rank of its pipeline stage that holds shards
    of the same shapes (a rank's shards differ only where a dim splits unevenly, e.g. a 1-row weight over dp)."""
    modules: list
    params: list
    coords: MeshCoords
    dtensors: list = field(default_factory=list)
    shapes: list = field(default_factory=list)

    def __post_init__(self):
        from torch.distributed.tensor import DTensor

        self.dtensors = [p for _, m in self.modules for p in m.parameters() if isinstance(p, DTensor)]
        self.shapes = [tuple(p.to_local().shape) for p in self.dtensors]
        for p in self.dtensors:
            self.coords.add(p.device_mesh)

    def fits(self, rank: int) -> bool:
        """Whether `rank`'s shard of every DTensor parameter, at its coordinate in its group, has this share's
        shape (DTensor's own rule for a coordinate's local shape)."""
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

        for p, shape in zip(self.dtensors, self.shapes):
            coordinate = self.coords.of(p.device_mesh, rank)
            if coordinate is None or tuple(_compute_local_shape_and_global_offset(
                    p.shape, p.device_mesh.shape, coordinate, p.placements, skip_offset=True)[0]) != shape:
                return False
        return True
