"""Robustness perturbations of LIBERO episodes for `dz eval libero --perturb NAME[=VALUE][,...]` (and `eval.perturb`
in params.yaml).

Each perturbation is a named setting with one magnitude. It changes what it names and nothing else: the env seed,
the standard init state, the robot's start, the other objects, the other cameras, the lights, the table and the
instruction stay as they are unless they are the perturbation. Its random draws come from its own generator, seeded
by (eval seed, suite, task, init state, perturbation name), never from the global numpy generator LIBERO's reset
uses, so the same episode gets the same perturbation on every run and every worker.

The scene perturbations edit the MuJoCo model and the init state after `env.reset()` and before
`env.set_init_state()` (`apply_scene`, called in the env worker); LIBERO rebuilds the model at every reset, so an
edit never outlives its episode. The worker then runs the usual settle steps (no-op actions) from the edited start.

| name | setting (default) | what changes | what stays |
|---|---|---|---|
| position | D metres (0.05) | every movable object's free-joint x/y, moved by exactly D in a seeded direction; objects stacked on one another move together | z, orientation, fixtures, objects held by a fixture (on a cabinet, in a drawer, on a stove), robot |
| swap | task or any (task) | the x/y of two movable objects of different kinds (task: one of them an object the goal names) | everything else, their own z and orientation |
| camera | degrees (10) | the agentview camera's pose: orbited about the table point it looks at, azimuth +-A, elevation +-A/2 (seeded signs), distance kept | the wrist camera, the other cameras, fov |
| light | factor F (0.5) | every scene light's diffuse and specular colour times F or 1/F (seeded), its direction tilted 20 degrees towards a seeded azimuth | light positions, ambient, headlight |
| table | colour name or random (random) | the work surface's look (table top, or the floor in floor scenes): a plain colour instead of its material | its collision geometry, the legs, the floor and walls |
| paraphrase | 1, 2, 3 or random (random) | the instruction the policy reads: one of three hand-written paraphrases of the task's | the env, the task's goal and success check |
| distractor | N objects, 1 to 5 (2) | N objects of kinds the task does not have, each resting on the work surface at a seeded place clear of every body and of the places the goal names | the task's objects, robot and fixtures (their init state values), the goal, the instruction |

A moved start must be a valid start: an object is shifted only where, after the shift, the first surface below it is
the same one as before at the same height (still on the table, not over its edge or onto a fixture) and it comes no
closer than `CLEARANCE_M` to any body it was not already touching (other objects, fixtures, the robot). Directions
are redrawn (seeded) until that holds; an episode where no draw does is an error naming the object.

Distractors need bodies the task's model does not have, so the env of such an episode is built from another BDDL
problem (`scene_bddl`, called in the env worker before it builds the env): a copy of the task's with the distractor
objects declared and given an init region on the work surface, its goal untouched. Their kinds are fixed per task
(seeded by eval seed, suite and task), so a worker builds that env once per task; their places are drawn per
episode. `place_distractors` then maps the standard init state into the larger model joint by joint (the added
joints are skipped; the rest keep MuJoCo's order) and places each distractor: a seeded x/y within the task's objects'
extent (grown by AREA_MARGIN_M) and yaw, lowered until its collision geoms are REST_GAP_M above the surface, valid
where the surface lies straight below its whole footprint, it keeps CLEARANCE_M from every other body and its box
stays off every place the goal names. Up to MAX_DRAWS draws each, else an error naming it and the task's objects.

The names, settings and their parsing are `perturb_spec.py` (re-exported here), which the params check imports
without this module's simulator code.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .perturb_spec import (KINDS, MAX_DISTRACTORS, MIN_DISTRACTORS, TABLE_COLOURS, Kind,  # noqa: F401
                           Perturbation, PerturbationError, parse_perturbations)

CLEARANCE_M = 0.005      # a moved object keeps at least this distance from bodies it did not touch before
MAX_DRAWS = 200          # seeded direction draws per object group before the perturbation gives up
LIGHT_TILT_DEG = 20.0    # how far `light` turns each light's direction
SUPPORT_TOLERANCE_M = 0.01


def episode_rng(key: tuple, name: str) -> np.random.Generator:
    """The generator of one perturbation of one episode: key = (eval seed, suite, task index, init state index)."""
    seed, suite, task, init = key
    return np.random.default_rng([int(seed), zlib.crc32(str(suite).encode()), int(task), int(init),
                                  zlib.crc32(name.encode())])


# --- paraphrased instructions ------------------------------------------------------------------------------------

# Three paraphrases per task of LIBERO-Spatial, -Object, -Goal and -10, keyed by the task's own instruction. Each
# names the same objects, places and spatial relations as the original.
PARAPHRASES: dict[str, tuple[str, str, str]] = {
    # LIBERO-Spatial
    "pick up the black bowl between the plate and the ramekin and place it on the plate": (
        "take the black bowl that sits between the plate and the ramekin and put it on the plate",
        "grab the black bowl located between the ramekin and the plate, then set it on the plate",
        "move the black bowl from between the plate and the ramekin onto the plate"),
    "pick up the black bowl next to the ramekin and place it on the plate": (
        "take the black bowl beside the ramekin and put it on the plate",
        "grab the black bowl that is next to the ramekin and set it on the plate",
        "move the black bowl sitting by the ramekin onto the plate"),
    "pick up the black bowl from table center and place it on the plate": (
        "take the black bowl in the middle of the table and put it on the plate",
        "grab the black bowl at the center of the table and set it on the plate",
        "move the black bowl from the center of the table onto the plate"),
    "pick up the black bowl on the cookie box and place it on the plate": (
        "take the black bowl that is on top of the cookie box and put it on the plate",
        "grab the black bowl resting on the cookie box and set it on the plate",
        "move the black bowl from the cookie box onto the plate"),
    "pick up the black bowl in the top drawer of the wooden cabinet and place it on the plate": (
        "take the black bowl out of the wooden cabinet's top drawer and put it on the plate",
        "grab the black bowl inside the top drawer of the wooden cabinet and set it on the plate",
        "move the black bowl from the top drawer of the wooden cabinet onto the plate"),
    "pick up the black bowl on the ramekin and place it on the plate": (
        "take the black bowl that is on top of the ramekin and put it on the plate",
        "grab the black bowl resting on the ramekin and set it on the plate",
        "move the black bowl from the ramekin onto the plate"),
    "pick up the black bowl next to the cookie box and place it on the plate": (
        "take the black bowl beside the cookie box and put it on the plate",
        "grab the black bowl that is next to the cookie box and set it on the plate",
        "move the black bowl sitting by the cookie box onto the plate"),
    "pick up the black bowl on the stove and place it on the plate": (
        "take the black bowl that is on the stove and put it on the plate",
        "grab the black bowl sitting on the stove and set it on the plate",
        "move the black bowl from the stove onto the plate"),
    "pick up the black bowl next to the plate and place it on the plate": (
        "take the black bowl beside the plate and put it on the plate",
        "grab the black bowl that is next to the plate and set it on the plate",
        "move the black bowl sitting by the plate onto the plate"),
    "pick up the black bowl on the wooden cabinet and place it on the plate": (
        "take the black bowl that is on top of the wooden cabinet and put it on the plate",
        "grab the black bowl resting on the wooden cabinet and set it on the plate",
        "move the black bowl from the top of the wooden cabinet onto the plate"),
    # LIBERO-Object
    "pick up the alphabet soup and place it in the basket": (
        "take the alphabet soup and put it in the basket",
        "grab the can of alphabet soup and drop it into the basket",
        "move the alphabet soup into the basket"),
    "pick up the cream cheese and place it in the basket": (
        "take the cream cheese and put it in the basket",
        "grab the cream cheese box and drop it into the basket",
        "move the cream cheese into the basket"),
    "pick up the salad dressing and place it in the basket": (
        "take the salad dressing and put it in the basket",
        "grab the bottle of salad dressing and drop it into the basket",
        "move the salad dressing into the basket"),
    "pick up the bbq sauce and place it in the basket": (
        "take the bbq sauce and put it in the basket",
        "grab the bottle of barbecue sauce and drop it into the basket",
        "move the bbq sauce into the basket"),
    "pick up the ketchup and place it in the basket": (
        "take the ketchup and put it in the basket",
        "grab the ketchup bottle and drop it into the basket",
        "move the ketchup into the basket"),
    "pick up the tomato sauce and place it in the basket": (
        "take the tomato sauce and put it in the basket",
        "grab the can of tomato sauce and drop it into the basket",
        "move the tomato sauce into the basket"),
    "pick up the butter and place it in the basket": (
        "take the butter and put it in the basket",
        "grab the box of butter and drop it into the basket",
        "move the butter into the basket"),
    "pick up the milk and place it in the basket": (
        "take the milk and put it in the basket",
        "grab the milk carton and drop it into the basket",
        "move the milk into the basket"),
    "pick up the chocolate pudding and place it in the basket": (
        "take the chocolate pudding and put it in the basket",
        "grab the box of chocolate pudding and drop it into the basket",
        "move the chocolate pudding into the basket"),
    "pick up the orange juice and place it in the basket": (
        "take the orange juice and put it in the basket",
        "grab the orange juice carton and drop it into the basket",
        "move the orange juice into the basket"),
    # LIBERO-Goal
    "open the middle drawer of the cabinet": (
        "pull the cabinet's middle drawer open",
        "open the cabinet's middle drawer",
        "slide out the middle drawer of the cabinet"),
    "put the bowl on the stove": (
        "place the bowl on top of the stove",
        "set the bowl down on the stove",
        "move the bowl onto the stove"),
    "put the wine bottle on top of the cabinet": (
        "place the wine bottle on the top of the cabinet",
        "set the wine bottle down on top of the cabinet",
        "move the wine bottle onto the cabinet's top"),
    "open the top drawer and put the bowl inside": (
        "pull the top drawer open and place the bowl in it",
        "open the top drawer, then put the bowl into it",
        "slide out the top drawer and set the bowl inside it"),
    "put the bowl on top of the cabinet": (
        "place the bowl on the top of the cabinet",
        "set the bowl down on top of the cabinet",
        "move the bowl onto the cabinet's top"),
    "push the plate to the front of the stove": (
        "slide the plate so it is in front of the stove",
        "push the plate over to the front of the stove",
        "move the plate in front of the stove by pushing it"),
    "put the cream cheese in the bowl": (
        "place the cream cheese inside the bowl",
        "set the cream cheese into the bowl",
        "move the cream cheese into the bowl"),
    "turn on the stove": (
        "switch the stove on",
        "turn the stove on",
        "switch on the stove"),
    "put the bowl on the plate": (
        "place the bowl on top of the plate",
        "set the bowl down on the plate",
        "move the bowl onto the plate"),
    "put the wine bottle on the rack": (
        "place the wine bottle on the wine rack",
        "set the wine bottle onto the rack",
        "move the wine bottle onto the rack"),
    # LIBERO-10
    "put both the alphabet soup and the tomato sauce in the basket": (
        "place the alphabet soup and the tomato sauce into the basket",
        "put the tomato sauce and the alphabet soup, both of them, in the basket",
        "move both the alphabet soup and the tomato sauce into the basket"),
    "put both the cream cheese box and the butter in the basket": (
        "place the cream cheese box and the butter into the basket",
        "put the butter and the cream cheese box, both of them, in the basket",
        "move both the cream cheese box and the butter into the basket"),
    "turn on the stove and put the moka pot on it": (
        "switch the stove on and place the moka pot on it",
        "turn the stove on, then set the moka pot on top of it",
        "switch on the stove and put the moka pot onto it"),
    "put the black bowl in the bottom drawer of the cabinet and close it": (
        "place the black bowl into the cabinet's bottom drawer and shut the drawer",
        "put the black bowl inside the bottom drawer of the cabinet, then close the drawer",
        "move the black bowl into the bottom drawer of the cabinet and push the drawer closed"),
    "put the white mug on the left plate and put the yellow and white mug on the right plate": (
        "place the white mug on the left plate and the yellow and white mug on the right plate",
        "set the white mug onto the plate on the left and the yellow and white mug onto the plate on the right",
        "move the white mug to the left plate and the yellow and white mug to the right plate"),
    "pick up the book and place it in the back compartment of the caddy": (
        "take the book and put it in the caddy's back compartment",
        "grab the book and set it into the rear compartment of the caddy",
        "move the book into the back compartment of the caddy"),
    "put the white mug on the plate and put the chocolate pudding to the right of the plate": (
        "place the white mug on the plate and set the chocolate pudding to the plate's right",
        "set the white mug onto the plate, then put the chocolate pudding on the right side of the plate",
        "move the white mug onto the plate and the chocolate pudding to the right of the plate"),
    "put both the alphabet soup and the cream cheese box in the basket": (
        "place the alphabet soup and the cream cheese box into the basket",
        "put the cream cheese box and the alphabet soup, both of them, in the basket",
        "move both the alphabet soup and the cream cheese box into the basket"),
    "put both moka pots on the stove": (
        "place the two moka pots on the stove",
        "set both of the moka pots down on the stove",
        "move the two moka pots onto the stove"),
    "put the yellow and white mug in the microwave and close it": (
        "place the yellow and white mug inside the microwave and shut the microwave",
        "put the yellow and white mug into the microwave, then close its door",
        "move the yellow and white mug into the microwave and close the microwave"),
}


def paraphrase(language: str, value: str, rng: np.random.Generator) -> str:
    """The paraphrase of an instruction: number `value` (1-3) of its entry, or a seeded pick for "random"."""
    options = PARAPHRASES.get(language.strip().lower())
    if options is None:
        raise PerturbationError(f"paraphrase: no paraphrases for the instruction {language!r} (the table holds "
                                "LIBERO-Spatial, -Object, -Goal and -10)")
    index = int(rng.integers(len(options))) if value == "random" else int(value) - 1
    return options[index]


def episode_language(language: str, perturbation: Perturbation | None, key: tuple) -> str:
    """The instruction the policy reads in an episode (`key` as `episode_rng`'s)."""
    if perturbation is None or perturbation.name != "paraphrase":
        return language
    return paraphrase(language, str(perturbation.value), episode_rng(key, perturbation.name))


# --- scene edits (inside the env worker) ---------------------------------------------------------------------------


def apply_scene(env, state, perturbations, key: tuple) -> tuple[np.ndarray, dict]:
    """Apply the scene perturbations of one episode to a freshly reset LIBERO env: model edits now, object moves in
    the returned init state (pass it to `env.set_init_state`). Returns (state, {label: what changed}). With
    `distractor` the env must be built from `scene_bddl(...)` and the returned state is one of its larger model."""
    state = np.array(state, dtype=np.float64, copy=True)
    info: dict = {}
    # distractors first: they change the model the state vector describes
    for p in sorted(perturbations, key=lambda p: p.name != "distractor"):
        if not p.scene:
            continue
        rng = episode_rng(key, p.name)
        if p.name == "distractor":
            state, info[p.label] = place_distractors(env, state, int(p.value), rng)
        elif p.name == "position":
            state, info[p.label] = shift_objects(env, state, float(p.value), rng)
        elif p.name == "swap":
            state, info[p.label] = swap_objects(env, state, str(p.value), rng)
        elif p.name == "camera":
            info[p.label] = move_camera(env, float(p.value), rng)
        elif p.name == "light":
            info[p.label] = change_lights(env, float(p.value), rng)
        elif p.name == "table":
            info[p.label] = recolour_surface(env, str(p.value), rng)
    return state, info


def _model(env):
    sim = env.env.sim
    return sim, sim.model._model, sim.data._data


def _name(m, kind: str, i: int) -> str:
    import mujoco

    return mujoco.mj_id2name(m, getattr(mujoco.mjtObj, kind), int(i)) or ""


@dataclass
class _Object:
    name: str
    root: int        # its top-level body
    adr: int         # index of its free joint's x in the flat state [time, qpos, qvel]
    category: str


def _objects(env) -> list[_Object]:
    """The movable objects (a free joint each), in name order."""
    inner = env.env
    sim, m, _ = _model(env)
    out = []
    for name in sorted(inner.objects_dict):
        obj = inner.objects_dict[name]
        body = sim.model.body_name2id(obj.root_body)
        joints = [j for j in range(m.njnt) if m.jnt_bodyid[j] == body and m.jnt_type[j] == 0]
        if joints:
            out.append(_Object(name, int(m.body_rootid[body]), 1 + int(m.jnt_qposadr[joints[0]]),
                               str(getattr(obj, "category_name", type(obj).__name__))))
    return out


def _set_state(env, state) -> None:
    sim = env.env.sim
    sim.set_state_from_flattened(state)
    sim.forward()


def _boxes(m, d, root: int) -> tuple[np.ndarray, np.ndarray]:
    """World axis-aligned bounds (lo, hi) of the geoms of a top-level body's subtree."""
    geoms = [g for g in range(m.ngeom) if m.body_rootid[m.geom_bodyid[g]] == root]
    lo, hi = np.full(3, np.inf), np.full(3, -np.inf)
    for g in geoms:
        centre = d.geom_xpos[g] + d.geom_xmat[g].reshape(3, 3) @ m.geom_aabb[g, :3]
        half = np.abs(d.geom_xmat[g].reshape(3, 3)) @ m.geom_aabb[g, 3:]
        lo, hi = np.minimum(lo, centre - half), np.maximum(hi, centre + half)
    return lo, hi


def _support(m, d, root: int) -> tuple[int, float]:
    """(top-level body, drop in metres) of the first surface straight below the body's lowest point (-1: none)."""
    import mujoco

    lo, hi = _boxes(m, d, root)
    start = np.array([(lo[0] + hi[0]) / 2, (lo[1] + hi[1]) / 2, lo[2] + 1e-3], dtype=np.float64)
    geom = np.zeros(1, dtype=np.int32)
    best, found = np.inf, -1
    # the ray starts inside the body's box: cast it past every geom of the body itself
    for _ in range(8):
        dist = mujoco.mj_ray(m, d, start, np.array([0.0, 0.0, -1.0]), None, 1, root, geom)
        if dist < 0:
            break
        hit_root = int(m.body_rootid[m.geom_bodyid[geom[0]]])
        if hit_root != root:
            best, found = dist, hit_root
            break
        start = start - np.array([0.0, 0.0, dist + 1e-4])
    return found, float(best if found >= 0 else -1.0)


@contextlib.contextmanager
def _margins(m, d, value: float):
    """MuJoCo's collision check with every geom's margin raised to `value`: contacts then include geoms up to that
    far apart. The bodies' margins are raised too (the broad phase pairs bodies by their boxes grown by them, so
    without it bodies a few millimetres apart are never compared). The model is restored on exit."""
    import mujoco

    geom, body = m.geom_margin.copy(), m.body_margin.copy()
    try:
        m.geom_margin[:] = np.maximum(geom, value)
        m.body_margin[:] = np.maximum(body, value)
        mujoco.mj_forward(m, d)
        yield
    finally:
        m.geom_margin[:], m.body_margin[:] = geom, body
        mujoco.mj_forward(m, d)


def _touching(m, d, clearance: float) -> set[tuple[int, int]]:
    """Pairs of top-level bodies with collision geoms closer than `clearance`."""
    with _margins(m, d, clearance):
        pairs = set()
        for c in d.contact[:d.ncon]:
            if c.dist < clearance:
                a, b = int(m.body_rootid[m.geom_bodyid[c.geom1]]), int(m.body_rootid[m.geom_bodyid[c.geom2]])
                if a != b:
                    pairs.add((min(a, b), max(a, b)))
        return pairs


def _groups(env, m, d, objects: list[_Object]) -> tuple[list[list[_Object]], list[_Object]]:
    """Movable objects in groups that move together (one resting on another), and those a fixture holds (resting
    on or in a fixture other than the work surface: they stay). Read at the current state."""
    inner = env.env
    sim = inner.sim
    fixture_roots = {int(m.body_rootid[sim.model.body_name2id(f.root_body)]) for f in inner.fixtures_dict.values()}
    by_root = {o.root: o for o in objects}
    parent = {o.name: o.name for o in objects}

    def find(n):
        while parent[n] != n:
            n = parent[n]
        return n

    held = []
    for o in objects:
        below, _ = _support(m, d, o.root)
        if below in by_root:
            parent[find(o.name)] = find(by_root[below].name)
        elif below in fixture_roots:
            held.append(o)
    held_names = {find(o.name) for o in held}
    groups: dict[str, list[_Object]] = {}
    for o in objects:
        groups.setdefault(find(o.name), []).append(o)
    free = [g for r, g in sorted(groups.items()) if r not in held_names]
    held_all = [o for r, g in sorted(groups.items()) if r in held_names for o in g]
    return free, held_all


def _valid(env, m, d, state, moved: list[_Object], base_support: dict, base_touch: set) -> bool:
    _set_state(env, state)
    for o in moved:
        below, drop = _support(m, d, o.root)
        was_below, was_drop = base_support[o.name]
        if below != was_below or abs(drop - was_drop) > SUPPORT_TOLERANCE_M:
            return False
    roots = {o.root for o in moved}
    new = _touching(m, d, CLEARANCE_M) - base_touch
    return not any(a in roots or b in roots for a, b in new)


def shift_objects(env, state, distance: float, rng: np.random.Generator) -> tuple[np.ndarray, dict]:
    """Every movable object group (objects stacked on one another move together) shifted by exactly `distance` in
    x/y, in a seeded direction redrawn until the start is valid (module docstring); objects a fixture holds stay."""
    sim, m, d = _model(env)
    objects = _objects(env)
    base = np.array(state, dtype=np.float64, copy=True)
    _set_state(env, base)
    free, held = _groups(env, m, d, objects)
    base_support = {o.name: _support(m, d, o.root) for o in objects}
    base_touch = _touching(m, d, CLEARANCE_M)
    out = base.copy()
    shifts = {}
    for group in free:
        for _ in range(MAX_DRAWS):
            angle = rng.uniform(0.0, 2 * math.pi)
            shift = distance * np.array([math.cos(angle), math.sin(angle)])
            trial = out.copy()
            for o in group:
                trial[o.adr:o.adr + 2] += shift
            if _valid(env, m, d, trial, group, base_support, base_touch):
                out = trial
                shifts.update({o.name: shift.round(4).tolist() for o in group})
                break
        else:
            _set_state(env, base)
            raise PerturbationError(f"position: no valid shift of {distance:g} m for {[o.name for o in group]} in "
                                    f"{MAX_DRAWS} seeded directions (the table, a fixture or another object is in "
                                    "the way): use a smaller distance")
    _set_state(env, out)
    return out, {"shift_xy": shifts, "held_by_fixture": [o.name for o in held]}


def swap_objects(env, state, which: str, rng: np.random.Generator) -> tuple[np.ndarray, dict]:
    """Two movable objects of different kinds, each alone on the work surface (nothing on it, not on a fixture),
    exchange their x/y (each keeps its own height and orientation). `task`: one of them is an object of the goal
    when such a pair exists. Pairs are tried in a seeded order until the start is valid."""
    sim, m, d = _model(env)
    objects = _objects(env)
    base = np.array(state, dtype=np.float64, copy=True)
    _set_state(env, base)
    free, _ = _groups(env, m, d, objects)
    single = [g[0] for g in free if len(g) == 1]
    base_support = {o.name: _support(m, d, o.root) for o in objects}
    base_touch = _touching(m, d, CLEARANCE_M)
    pairs = [(a, b) for i, a in enumerate(single) for b in single[i + 1:] if a.category != b.category]
    interest = set(getattr(env.env, "obj_of_interest", []) or [])
    if which == "task" and any(a.name in interest or b.name in interest for a, b in pairs):
        pairs = [(a, b) for a, b in pairs if a.name in interest or b.name in interest]
    for i in rng.permutation(len(pairs)):
        a, b = pairs[int(i)]
        trial = base.copy()
        trial[a.adr:a.adr + 2], trial[b.adr:b.adr + 2] = base[b.adr:b.adr + 2], base[a.adr:a.adr + 2]
        if _valid(env, m, d, trial, [a, b], base_support, base_touch):
            _set_state(env, trial)
            return trial, {"swapped": [a.name, b.name]}
    _set_state(env, base)
    raise PerturbationError(f"swap: no two movable objects of different kinds ({which}) can exchange places "
                            "without touching something")


def _quat_to_mat(q) -> np.ndarray:
    w, x, y, z = q / np.linalg.norm(q)
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                     [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                     [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]])


def _mat_to_quat(r: np.ndarray) -> np.ndarray:
    import mujoco

    q = np.zeros(4)
    mujoco.mju_mat2Quat(q, np.ascontiguousarray(r, dtype=np.float64).reshape(9))
    return q


def _rotation(axis, angle: float) -> np.ndarray:
    axis = np.asarray(axis, dtype=np.float64) / np.linalg.norm(axis)
    k = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    return np.eye(3) + math.sin(angle) * k + (1 - math.cos(angle)) * k @ k


def move_camera(env, degrees: float, rng: np.random.Generator, camera: str = "agentview") -> dict:
    """Orbit a fixed world camera about the point where its optical axis meets the table top (the work surface's
    height; 1 m ahead if it looks above it): azimuth +-degrees about the vertical, elevation +-degrees/2 about its
    horizontal right axis (seeded signs); the distance to that point and the field of view are kept."""
    import mujoco

    sim, m, d = _model(env)
    cam = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_CAMERA, camera)
    if cam < 0 or m.cam_bodyid[cam] != 0:
        raise PerturbationError(f"camera: no world-fixed camera {camera!r} in this scene")
    pos, rot = m.cam_pos[cam].copy(), _quat_to_mat(m.cam_quat[cam].copy())
    forward = -rot[:, 2]
    height = _surface_height(env)
    t = (height - pos[2]) / forward[2] if forward[2] < -1e-6 else 1.0
    target = pos + forward * (t if 0 < t < 5 else 1.0)
    azimuth = math.radians(degrees) * (1 if rng.random() < 0.5 else -1)
    elevation = math.radians(degrees / 2) * (1 if rng.random() < 0.5 else -1)
    right = rot[:, 0].copy()
    right[2] = 0.0
    turn = _rotation([0, 0, 1], azimuth) @ _rotation(right, elevation)
    new_pos = target + turn @ (pos - target)
    new_rot = turn @ rot
    m.cam_pos[cam] = new_pos
    m.cam_quat[cam] = _mat_to_quat(new_rot)
    return {"camera": camera, "azimuth_deg": round(math.degrees(azimuth), 3),
            "elevation_deg": round(math.degrees(elevation), 3), "pos": new_pos.round(4).tolist()}


def change_lights(env, factor: float, rng: np.random.Generator) -> dict:
    """Every scene light: diffuse and specular colour times `factor` or 1/`factor` (one seeded choice for the
    episode), its direction tilted LIGHT_TILT_DEG towards a seeded azimuth."""
    sim, m, d = _model(env)
    scale = factor if rng.random() < 0.5 else 1.0 / factor
    tilts = []
    for i in range(m.nlight):
        m.light_diffuse[i] = m.light_diffuse[i] * scale
        m.light_specular[i] = m.light_specular[i] * scale
        direction = m.light_dir[i] / np.linalg.norm(m.light_dir[i])
        azimuth = rng.uniform(0.0, 2 * math.pi)
        sideways = np.cross(direction, [math.cos(azimuth), math.sin(azimuth), 0.0])
        if np.linalg.norm(sideways) < 1e-6:
            sideways = np.array([1.0, 0.0, 0.0])
        m.light_dir[i] = _rotation(sideways, math.radians(LIGHT_TILT_DEG)) @ direction
        tilts.append(round(math.degrees(azimuth), 2))
    return {"intensity_scale": round(scale, 4), "lights": m.nlight, "tilt_azimuth_deg": tilts}


def surface_geoms(env) -> list[int]:
    """The visual geoms of the work surface: the table top (`table_visual`), the workspace table's visual meshes
    (living room, study), or the floor (floor scenes)."""
    import mujoco

    sim, m, d = _model(env)
    top = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_GEOM, "table_visual")
    if top >= 0:
        return [top]
    workspace = str(getattr(env.env, "workspace_name", ""))
    if workspace and workspace != "floor":
        geoms = [g for g in range(m.ngeom) if _name(m, "mjOBJ_BODY", m.geom_bodyid[g]).startswith(workspace)
                 and m.geom_contype[g] == 0 and m.geom_conaffinity[g] == 0]
        if geoms:
            return geoms
    floor = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_GEOM, "floor")
    if floor < 0:
        raise PerturbationError("table: this scene has no table top, workspace table or floor geom")
    return [floor]


def _surface_height(env) -> float:
    sim, m, d = _model(env)
    lo, hi = np.inf, -np.inf
    for g in surface_geoms(env):
        if m.geom_type[g] == 0:  # a plane
            hi = max(hi, float(d.geom_xpos[g][2]))
        else:
            centre = d.geom_xpos[g] + d.geom_xmat[g].reshape(3, 3) @ m.geom_aabb[g, :3]
            hi = max(hi, float(centre[2] + (np.abs(d.geom_xmat[g].reshape(3, 3)) @ m.geom_aabb[g, 3:])[2]))
    return hi


def recolour_surface(env, colour: str, rng: np.random.Generator) -> dict:
    """The work surface's visual geoms drawn in a plain colour (no material, so no texture); `random`: a seeded
    pick of TABLE_COLOURS. Collision geoms and every other geom are untouched."""
    sim, m, d = _model(env)
    names = list(TABLE_COLOURS)
    if colour == "random":
        colour = names[int(rng.integers(len(names)))]
    geoms = surface_geoms(env)
    for g in geoms:
        m.geom_matid[g] = -1
        m.geom_rgba[g] = TABLE_COLOURS[colour]
    return {"colour": colour, "geoms": [_name(m, "mjOBJ_GEOM", g) or str(g) for g in geoms]}


# --- distractor objects (a BDDL problem of their own, then a placement inside the env worker) ----------------------

# Small graspable household objects of LIBERO's object library, by asset family. A task gets kinds of its own scene's
# family first (the family most of its objects come from), then of the others.
DISTRACTOR_KINDS: dict[str, tuple[str, ...]] = {
    "hope_objects": ("alphabet_soup", "bbq_sauce", "butter", "chocolate_pudding", "cookies", "cream_cheese",
                     "ketchup", "macaroni_and_cheese", "milk", "orange_juice", "popcorn", "salad_dressing",
                     "tomato_sauce"),
    "google_scanned_objects": ("akita_black_bowl", "white_bowl", "glazed_rim_porcelain_ramekin"),
    "turbosquid_objects": ("red_coffee_mug", "porcelain_mug", "white_yellow_mug"),
}
# where LIBERO keeps each family's models: <assets>/<folder>/<kind>/<kind>.xml
DISTRACTOR_ASSET_DIRS = {"hope_objects": "stable_hope_objects", "google_scanned_objects": "stable_scanned_objects",
                         "turbosquid_objects": "turbosquid_objects"}
DISTRACTOR_PREFIX = "distractor_"   # a distractor's instance name is this prefix and its kind
DISTRACTOR_REGION = "distractor_region"
WORKSPACES = ("table", "floor", "kitchen_table", "living_room_table", "study_table", "coffee_table")
REGION_MARGIN_M = 0.10   # the distractors' BDDL init region: the task's own work-surface regions grown by this
AREA_MARGIN_M = 0.10     # a distractor's centre lies within the task's objects' x/y extent grown by this
REST_GAP_M = 0.001       # a placed distractor's lowest point is this far above the work surface (it drops onto it)
_PARK_XY = (20.0, 20.0)  # where distractors not placed yet wait, away from everything
_bddl_dir: list[str] = []


def _block(text: str, head: str) -> tuple[int, int]:
    """(start, end) of the parenthesised BDDL block that opens with `head` (e.g. "(:objects"); end is past its `)`."""
    start = text.find(head)
    if start < 0:
        raise PerturbationError(f"distractor: the task's BDDL has no {head} block")
    depth = 0
    for end in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0:
            return start, end + 1
    raise PerturbationError(f"distractor: the task's BDDL {head} block is not closed")


def _declared(text: str, head: str) -> dict[str, str]:
    """{instance: kind} of a `(:objects ...)` or `(:fixtures ...)` block (`a b - kind` lines)."""
    start, end = _block(text, head)
    out = {}
    for line in text[start + len(head):end - 1].splitlines():
        names, sep, kind = line.partition(" - ")
        if sep:
            out.update({n: kind.strip() for n in names.split()})
    return out


def _family(kind: str) -> str:
    return next((f for f, kinds in DISTRACTOR_KINDS.items() if kind in kinds), "")


def _words(text: str) -> set[str]:
    return {w for w in text.lower().replace("_", " ").split() if w not in ("the", "and", "a", "of")}


def distractor_kinds(text: str, count: int, key: tuple) -> list[str]:
    """The kinds of a task's `count` distractors: candidates that share no word with the task's instruction or the
    kinds of its objects and fixtures (no second bowl where the instruction says "the bowl"), those of the task's
    own asset family first, each group in a seeded order. Seeded by (eval seed, suite, task), so every episode of a
    task uses one env."""
    start, end = _block(text, "(:language")
    taken = _words(text[start + len("(:language"):end - 1])
    objects = _declared(text, "(:objects")
    for kind in [*objects.values(), *_declared(text, "(:fixtures").values()]:
        taken |= _words(kind)
    free = [k for kinds in DISTRACTOR_KINDS.values() for k in kinds if not _words(k) & taken]
    families = [_family(k) for k in objects.values()]
    own = max(set(families), key=families.count) if families else ""
    rng = episode_rng((key[0], key[1], key[2], 0), "distractor kinds")
    first = [k for k in free if _family(k) == own]
    rest = [k for k in free if _family(k) != own]
    ordered = [first[i] for i in rng.permutation(len(first))] + [rest[i] for i in rng.permutation(len(rest))]
    if len(ordered) < count:
        raise PerturbationError(f"distractor: only {len(ordered)} object kinds share nothing with this task "
                                f"({', '.join(ordered) or 'none'}); use distractor={len(ordered)} or fewer")
    return ordered[:count]


def distractor_asset(kind: str) -> Path:
    """A distractor kind's model file, relative to LIBERO's assets folder."""
    return Path(DISTRACTOR_ASSET_DIRS[_family(kind)]) / kind / f"{kind}.xml"


def check_distractor_assets(assets: Path, tasks, count: int, seed: int) -> None:
    """PerturbationError, before any episode runs, if the installed assets lack a model that `distractor=count`
    would add to one of `tasks` (TaskSpecs): an env that cannot be built is an install problem, not a failure of
    the policy. The kinds are the ones `scene_bddl` picks for each task under this eval seed."""
    missing: dict[str, list[int]] = {}
    for t in tasks:
        text = Path(t.bddl_file).read_text()
        for kind in distractor_kinds(text, count, (seed, t.suite, t.index)):
            path = Path(assets) / distractor_asset(kind)
            if not path.is_file():
                missing.setdefault(str(path), []).append(t.index)
    if missing:
        listed = "; ".join(f"{p} (task {', '.join(map(str, ts))})" for p, ts in sorted(missing.items()))
        raise PerturbationError(
            f"distractor={count}: LIBERO's assets lack {len(missing)} object model(s) this evaluation would add: "
            f"{listed}. Install the full asset set (`make libero`), or leave distractor out of eval.perturb")


def distractor_problem(text: str, kinds: list[str]) -> str:
    """A copy of a task's BDDL problem with one object of each kind added (`distractor_<kind>`), each placed by
    LIBERO's reset in a region of the work surface that spans the task's own regions there (grown by
    REGION_MARGIN_M). The goal, the objects of interest and everything else are the task's own."""
    fixtures = _declared(text, "(:fixtures")
    surface = next((n for n, k in fixtures.items() if k in WORKSPACES), None)
    if surface is None:
        raise PerturbationError("distractor: the task's BDDL names no table or floor among its fixtures")
    start, end = _block(text, "(:regions")
    ranges = []
    for region in _region_blocks(text[start:end]):
        if f"(:target {surface})" in region:
            ranges += [[float(v) for v in r.split()] for r in _ranges(region)]
    if not ranges:
        raise PerturbationError(f"distractor: the task's BDDL has no region on {surface}")
    lo = np.min(np.array(ranges)[:, :2], axis=0) - REGION_MARGIN_M
    hi = np.max(np.array(ranges)[:, 2:], axis=0) + REGION_MARGIN_M
    region = (f"      ({DISTRACTOR_REGION}\n          (:target {surface})\n          (:ranges (\n"
              f"              ({lo[0]:.4f} {lo[1]:.4f} {hi[0]:.4f} {hi[1]:.4f})\n            )\n          )\n      )\n")
    names = [DISTRACTOR_PREFIX + k for k in kinds]
    out = text[:end - 1].rstrip(" ") + region + "    " + text[end - 1:]
    start, end = _block(out, "(:objects")
    out = out[:end - 1].rstrip(" ") + "".join(f"    {n} - {k}\n" for n, k in zip(names, kinds)) + "  " + out[end - 1:]
    start, end = _block(out, "(:init")
    return out[:end - 1].rstrip(" ") + "".join(f"    (On {n} {surface}_{DISTRACTOR_REGION})\n" for n in names) \
        + "  " + out[end - 1:]


def _region_blocks(regions: str) -> list[str]:
    """The region definitions inside a `(:regions ...)` block."""
    out, depth, begin = [], 0, None
    for i, ch in enumerate(regions):
        if ch == "(":
            depth += 1
            if depth == 2:
                begin = i
        elif ch == ")":
            if depth == 2 and begin is not None:
                out.append(regions[begin:i + 1])
            depth -= 1
    return out


def _ranges(region: str) -> list[str]:
    if "(:ranges" not in region:
        return []
    start, end = _block(region, "(:ranges")
    inner = region[start + len("(:ranges"):end - 1]
    return [r.strip("() \n") for r in inner.split("(") if r.strip("() \n")]


def scene_bddl(bddl_file: str, perturbations, key: tuple) -> str:
    """The BDDL file an episode's env is built from: the task's own, or with a `distractor` perturbation a copy that
    adds the distractors (`distractor_problem`), written once per content into a folder of this process."""
    wanted = [p for p in perturbations if p.name == "distractor"]
    if not wanted:
        return bddl_file
    import atexit
    import hashlib
    import shutil
    import tempfile

    text = Path(bddl_file).read_text()
    problem = distractor_problem(text, distractor_kinds(text, int(wanted[0].value), key))
    if not _bddl_dir:
        _bddl_dir.append(tempfile.mkdtemp(prefix="dzmodel-bddl-"))
        atexit.register(shutil.rmtree, _bddl_dir[0], True)
    path = Path(_bddl_dir[0]) / f"{Path(bddl_file).stem}_{hashlib.sha1(problem.encode()).hexdigest()[:12]}.bddl"
    if not path.is_file():
        path.write_text(problem)
    return str(path)


def _joint_sizes(jtype: int) -> tuple[int, int]:
    """(qpos, qvel) sizes of a MuJoCo joint type: free, ball, slide, hinge."""
    return {0: (7, 6), 1: (4, 3)}.get(int(jtype), (1, 1))


def map_state(env, state, skip_roots: set[int]) -> np.ndarray:
    """A flat [time, qpos, qvel] state of the task's own model as a state of this env's larger model: every joint
    not of a body in `skip_roots` gets its values, in order (MuJoCo orders joints by the body tree, which the added
    bodies leave in place); the skipped joints keep this env's current values."""
    sim, m, d = _model(env)
    state = np.asarray(state, dtype=np.float64)
    own = [j for j in range(m.njnt) if int(m.body_rootid[m.jnt_bodyid[j]]) not in skip_roots]
    nq = sum(_joint_sizes(m.jnt_type[j])[0] for j in own)
    nv = sum(_joint_sizes(m.jnt_type[j])[1] for j in own)
    if state.shape != (1 + nq + nv,):
        raise PerturbationError(f"distractor: the init state has {state.size} values, the task's model "
                                f"{1 + nq + nv} ([time, qpos, qvel])")
    out = np.array(env.get_sim_state(), dtype=np.float64, copy=True)
    if out.shape != (1 + m.nq + m.nv,):
        raise PerturbationError("distractor: this env's state is not [time, qpos, qvel]")
    out[0] = state[0]
    q, v = 1, 1 + nq
    for j in own:
        sq, sv = _joint_sizes(m.jnt_type[j])
        out[1 + m.jnt_qposadr[j]:1 + m.jnt_qposadr[j] + sq] = state[q:q + sq]
        out[1 + m.nq + m.jnt_dofadr[j]:1 + m.nq + m.jnt_dofadr[j] + sv] = state[v:v + sv]
        q, v = q + sq, v + sv
    return out


def _collision_geoms(m, root: int) -> list[int]:
    return [g for g in range(m.ngeom) if int(m.body_rootid[m.geom_bodyid[g]]) == root
            and (m.geom_contype[g] or m.geom_conaffinity[g])]


def _gap(m, d, root: int, surface: int, probe: float = 0.02) -> float | None:
    """The smallest distance between a body's collision geoms and the work surface's (None: farther than `probe`)."""
    with _margins(m, d, probe):
        gaps = [c.dist for c in d.contact[:d.ncon]
                if {int(m.body_rootid[m.geom_bodyid[c.geom1]]), int(m.body_rootid[m.geom_bodyid[c.geom2]])}
                == {root, surface}]
    return float(min(gaps)) if gaps else None


def _surface_root(env, m, d, objects: list[_Object]) -> int:
    """The top-level body most of the task's objects rest on: the table, or the world (the floor)."""
    inner = env.env
    sim = inner.sim
    roots = {o.root for o in objects}
    fixtures = {int(m.body_rootid[sim.model.body_name2id(f.root_body)]) for n, f in inner.fixtures_dict.items()
                if n != getattr(inner, "workspace_name", "")}
    below = [_support(m, d, o.root)[0] for o in objects]
    below = [b for b in below if b >= 0 and b not in roots and b not in fixtures]
    if not below:
        raise PerturbationError("distractor: none of the task's objects rests on the work surface")
    return max(set(below), key=below.count)


def _goal_boxes(env, m, d) -> list[tuple[np.ndarray, np.ndarray]]:
    """x/y boxes of the places the goal names (the second argument of each goal predicate): a region's site, or an
    object's or fixture's geoms."""
    import mujoco

    inner = env.env
    out = []
    for pred in inner.parsed_problem.get("goal_state", []):
        for target in pred[2:]:
            site = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_SITE, target)
            if site >= 0:
                half = (np.abs(d.site_xmat[site].reshape(3, 3)) @ m.site_size[site] if m.site_type[site] == 6
                        else np.full(3, m.site_size[site][0]))
                out.append((d.site_xpos[site][:2] - half[:2], d.site_xpos[site][:2] + half[:2]))
                continue
            owner = inner.objects_dict.get(target) or inner.fixtures_dict.get(target)
            if owner is not None:
                lo, hi = _boxes(m, d, int(m.body_rootid[inner.sim.model.body_name2id(owner.root_body)]))
                out.append((lo[:2], hi[:2]))
    return out


def _yaw_quat(angle: float, quat) -> np.ndarray:
    """A (w, x, y, z) orientation turned by `angle` about the world vertical."""
    return _mat_to_quat(_rotation([0, 0, 1], angle) @ _quat_to_mat(np.asarray(quat, dtype=np.float64)))


def place_distractors(env, state, count: int, rng: np.random.Generator) -> tuple[np.ndarray, dict]:
    """The task's init state mapped into this env's model (built from `scene_bddl`), with each distractor at a
    seeded place: its centre within the task's objects' x/y extent grown by AREA_MARGIN_M, turned by a seeded yaw
    (upright as LIBERO's reset stands it), its lowest point REST_GAP_M above the work surface, the surface straight
    below its whole footprint, at least CLEARANCE_M from every other body and outside the x/y box of every place the
    goal names. Up to MAX_DRAWS draws per distractor."""
    sim, m, d = _model(env)
    objects = _objects(env)
    extra = [o for o in objects if o.name.startswith(DISTRACTOR_PREFIX)]
    task = [o for o in objects if not o.name.startswith(DISTRACTOR_PREFIX)]
    if len(extra) != count:
        raise PerturbationError(f"distractor: this env has {len(extra)} distractor objects, not {count} (build it "
                                "from libero_perturb.scene_bddl)")
    out = map_state(env, state, {o.root for o in extra})
    upright = {o.name: out[o.adr + 3:o.adr + 7].copy() for o in extra}
    for i, o in enumerate(extra):
        out[o.adr:o.adr + 3] = (_PARK_XY[0] + 2.0 * i, _PARK_XY[1], 1.0)
    _set_state(env, out)
    surface = _surface_root(env, m, d, task)
    boxes = [_boxes(m, d, o.root) for o in task]
    area_lo = np.min([b[0][:2] for b in boxes], axis=0) - AREA_MARGIN_M
    area_hi = np.max([b[1][:2] for b in boxes], axis=0) + AREA_MARGIN_M
    goal = _goal_boxes(env, m, d)
    base_touch = _touching(m, d, CLEARANCE_M)
    top = max(b[1][2] for b in boxes)  # distractors are lowered from above every object
    placed = {}
    for o in extra:
        for _ in range(MAX_DRAWS):
            trial = out.copy()
            trial[o.adr:o.adr + 2] = rng.uniform(area_lo, area_hi)
            trial[o.adr + 2] = top + 0.2
            trial[o.adr + 3:o.adr + 7] = _yaw_quat(rng.uniform(0.0, 2 * math.pi), upright[o.name])
            if _rest_valid(env, m, d, trial, o, surface, goal, base_touch):
                out = trial
                placed[o.name] = out[o.adr:o.adr + 3].round(4).tolist()
                break
        else:
            _set_state(env, out)
            raise PerturbationError(f"distractor: no free place for {o.name} among {[t.name for t in task]} in "
                                    f"{MAX_DRAWS} seeded draws (the work surface is crowded): use fewer distractors")
    _set_state(env, out)
    return out, {"placed": placed, "kinds": [o.category for o in extra]}


def _rest_valid(env, m, d, trial, o: _Object, surface: int, goal, base_touch) -> bool:
    """Lowers the distractor in `trial` (in place) until its collision geoms are REST_GAP_M above the work surface
    and says whether that is a valid place (module docstring)."""
    _set_state(env, trial)
    lo, hi = _boxes(m, d, o.root)
    below, height = _below(m, d, np.array([(lo[0] + hi[0]) / 2, (lo[1] + hi[1]) / 2, hi[2] + 1e-3]), o.root)
    if below != surface:
        return False
    trial[o.adr + 2] -= lo[2] - height - REST_GAP_M  # its box's bottom just above the surface
    _set_state(env, trial)
    gap = _gap(m, d, o.root, surface)
    if gap is None:
        return False
    trial[o.adr + 2] -= gap - REST_GAP_M  # its collision geoms just above the surface
    _set_state(env, trial)
    lo, hi = _boxes(m, d, o.root)
    corners = [(x, y) for x in (lo[0], (lo[0] + hi[0]) / 2, hi[0]) for y in (lo[1], (lo[1] + hi[1]) / 2, hi[1])]
    if any(_below(m, d, np.array([x, y, hi[2] + 1e-3]), o.root)[0] != surface for x, y in corners):
        return False
    for g_lo, g_hi in goal:
        if np.all(lo[:2] < g_hi + CLEARANCE_M) and np.all(hi[:2] > g_lo - CLEARANCE_M):
            return False
    new = _touching(m, d, CLEARANCE_M) - base_touch
    return not any(o.root in (a, b) and surface not in (a, b) for a, b in new)


def _below(m, d, point: np.ndarray, root: int) -> tuple[int, float]:
    """(top-level body, height of the hit) of the first geom straight below a point, the geoms of the top-level body
    `root` passed through ((-1, nan): none)."""
    import mujoco

    geom = np.zeros(1, dtype=np.int32)
    start = np.array(point, dtype=np.float64)
    for _ in range(32):
        dist = mujoco.mj_ray(m, d, start, np.array([0.0, 0.0, -1.0]), None, 1, -1, geom)
        if dist < 0:
            break
        hit = int(m.body_rootid[m.geom_bodyid[geom[0]]])
        if hit != root:
            return hit, float(start[2] - dist)
        start = start - np.array([0.0, 0.0, dist + 1e-4])
    return -1, math.nan
