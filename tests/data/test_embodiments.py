"""Embodiments from YAML: the built-ins, a new robot from YAML alone, and clear errors."""

import pytest

from dzmodel.data.embodiments import get_embodiment, load_embodiments, parse_embodiment
from dzmodel.data.errors import DataError


def test_builtins_match_the_reference():
    reg = load_embodiments()
    assert {"libero_sim", "oxe_droid", "franka_pnp"} <= set(reg)
    lib, droid, franka = reg["libero_sim"], reg["oxe_droid"], reg["franka_pnp"]
    assert lib.action_horizon == 16 and droid.action_horizon == 24 and franka.action_horizon == 12
    assert lib.image_size == (256, 512) and droid.image_size == (352, 640) and franka.image_size == (256, 512)
    assert droid.relative_action_keys == ("joint_position",)
    assert [c.width for c in droid.layout[0]] == [2]
    assert lib.tag_id == 21 and droid.tag_id == 17
    p = lib.prompt("Put the Bowl on the plate.")
    assert p.startswith("A multi-view video shows that a robot put the bowl on the plate The video is split")
    assert p.endswith("The robot put the bowl on the plate")


def test_droid_in_the_5b_frame_is_droid_at_the_5b_encoders_size():
    """oxe_droid_5b lays DROID's views out in the 5B's input frame (upstream resizes the 352x640 layout to it), and
    differs from oxe_droid in nothing else."""
    from dataclasses import replace

    from dzmodel.model.components import ENCODERS

    reg = load_embodiments()
    droid, droid_5b = reg["oxe_droid"], reg["oxe_droid_5b"]
    assert droid_5b.image_size == ENCODERS["dreamzero_5b"].image_size == (176, 320)
    assert droid.image_size == ENCODERS["dreamzero_14b"].image_size
    assert replace(droid_5b, tag=droid.tag, view_size=droid.view_size, source=droid.source) == droid


@pytest.mark.parametrize("name, base", [("libero_sim_5b", "libero_sim"), ("franka_pnp_5b", "franka_pnp")])
def test_libero_and_franka_in_upstreams_5b_frame(name, base):
    """Upstream's 5B LIBERO and Franka configs resize the two 256x256 views' 256x512 layout to 160x320 (an even
    latent height, unlike 176x320): the _5b embodiments lay them out so, and differ from theirs in nothing else."""
    from dataclasses import replace

    reg = load_embodiments()
    five_b, full = reg[name], reg[base]
    assert full.image_size == (256, 512) and five_b.image_size == (160, 320)
    assert replace(five_b, tag=full.tag, view_size=full.view_size, source=full.source) == full


def test_a_new_embodiment_from_yaml_alone(tmp_path):
    path = tmp_path / "my_robots.yaml"
    path.write_text("""
ur5_kitchen:
  tag_id: 40
  views: {front: observation.images.front, side: observation.images.side, hand: observation.images.hand}
  view_size: [64, 96]
  layout: [[front, side], ["hand*2"]]
  state: {joints: {column: observation.state, slice: [0, 6]}, gripper: {column: observation.state, slice: [6, 7]}}
  action: {joints: {column: action, slice: [0, 6]}, gripper: {column: action, slice: [6, 7]}}
  action_horizon: 10
  relative_action_keys: [joints]
  prompt_template: "The arm will {instruction}."
  sampling: fixed_window
""")
    reg = load_embodiments([path])
    emb = get_embodiment("ur5_kitchen", reg)
    assert emb.image_size == (128, 192)
    assert emb.prompt("Open The Fridge") == "The arm will open the fridge."
    assert emb.relative_action_keys == ("joints",) and emb.sampling == "fixed_window"
    assert "libero_sim" in reg  # built-ins stay


@pytest.mark.parametrize("patch,field", [
    ({"sampling": "random"}, "sampling"),
    ({"view_size": [0, 10]}, "view_size"),
    ({"layout": [["nope"]]}, "layout"),
    ({"layout": [["a", "b"], ["a"]]}, "layout"),
    ({"action_horizon": 0}, "action_horizon"),
    ({"relative_action_keys": ["x"]}, "relative_action_keys"),
    ({"state": {"s": {"column": "c", "slice": [3, 1]}}}, "state.s.slice"),
    ({"state": {"s": {"column": "c", "slice": [0, 3], "dim": 4}}}, "state.s"),
    ({"prompt_template": "no placeholder"}, "prompt_template"),
    ({"colour": 1}, "colour"),
])
def test_bad_fields_name_the_field(patch, field):
    raw = {"views": {"a": "k1", "b": "k2"}, "view_size": [8, 8], "layout": [["a", "b"]],
           "state": {"s": {"column": "c"}}, "action": {"a": {"column": "d"}}, "action_horizon": 4}
    raw.update(patch)
    with pytest.raises(DataError) as exc:
        parse_embodiment("bot", raw, source="robots.yaml")
    assert "robots.yaml" in str(exc.value) and "'bot'" in str(exc.value) and f"'{field}'" in str(exc.value)


def test_unknown_tag_and_bad_files(tmp_path):
    with pytest.raises(DataError, match="unknown embodiment tag 'nao'.*libero_sim"):
        get_embodiment("nao")
    with pytest.raises(DataError, match="not found"):
        load_embodiments([tmp_path / "missing.yaml"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [unclosed")
    with pytest.raises(DataError, match="bad.yaml: not valid YAML"):
        load_embodiments([bad])


def test_a_bad_entry_reports_only_itself(tmp_path):
    """One robot's broken entry must not take the other entries of its file down; asking for it names the file,
    the tag and the field."""
    good = {"views": {"cam": "observation.images.cam"}, "view_size": [8, 8], "layout": [["cam"]],
            "state": {"s": {"column": "observation.state"}}, "action": {"a": {"column": "action"}},
            "action_horizon": 4}
    bad = dict(good, action_horizon="four")
    path = tmp_path / "robots.yaml"
    import yaml

    path.write_text(yaml.safe_dump({"good_arm": good, "bad_arm": bad}))
    reg = load_embodiments([path])
    assert get_embodiment("good_arm", reg).action_horizon == 4
    with pytest.raises(DataError, match=r"robots.yaml: embodiment 'bad_arm', field 'action_horizon'"):
        get_embodiment("bad_arm", reg)
    assert "bad_arm" not in reg and "bad_arm" in reg.broken


G1 = {"kind": "humanoid", "name": "Unitree G1", "action_space": "joint", "action_mode": "absolute",
      "control_rate_hz": 50, "action_min": -1.0, "action_max": 1.0}


@pytest.mark.parametrize("patch, field, why", [
    ({"kind": "robot_dog"}, "robot.kind", "must be one of"),
    ({"name": " "}, "robot.name", "must name the robot"),
    ({"control_rate_hz": 0}, "robot.control_rate_hz", "must be in \\(0, 1000\\]"),
    ({"action_min": None}, "robot.action_min", "action_min and action_max come together"),
    ({"action_max": [1.0, 1.0]}, "robot.action_min", "has 2 numbers; the action has 3 dims"),
    ({"action_max": -2.0}, "robot.action_min", "must be below action_max"),
    ({"max_step_change": 0}, "robot.max_step_change", "must be positive"),
    ({"max_step_change": [True, 1, 1]}, "robot.max_step_change", "finite numbers"),
    ({"action_min": 10**400}, "robot.action_min", "finite numbers"),
    ({"kind": "franka"}, "robot.action_min", "a Franka is described by its site config"),
    ({"kind": "arm", "action_min": None, "action_max": None}, "robot.action_min", "needs action_min and action_max"),
])
def test_a_robot_block_with_limits_that_would_not_protect_names_the_field(patch, field, why):
    raw = {"views": {"a": "k1"}, "view_size": [8, 8], "layout": [["a"]], "state": {"s": {"column": "c", "dim": 3}},
           "action": {"a": {"column": "d", "dim": 3}}, "action_horizon": 4, "robot": {**G1, **patch}}
    with pytest.raises(DataError, match=why) as exc:
        parse_embodiment("bot", raw, source="robots.yaml")
    assert f"'{field}'" in str(exc.value)
    raw["robot"] = dict(G1)
    robot = parse_embodiment("bot", raw, source="robots.yaml").robot
    assert robot.action_min == (-1.0,) * 3 and robot.max_step_change is None
    raw["action"] = {"a": {"column": "d"}}  # no dim: one number cannot be spread over unknown dims
    with pytest.raises(DataError, match="needs each action key's `dim`"):
        parse_embodiment("bot", raw, source="robots.yaml")
