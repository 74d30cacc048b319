"""The microwave skills' geometry, read from the real simulator (no episode is run): of the In targets of LIBERO's
drawer and basket tasks, only the microwave's heating region is an enclosure (a drawer's region moves with its
drawer and belongs to the drawer skills), with the microwave's open side, floor and ceiling; and the door's outer
face is measured on the panel's own box, at every opening angle (the world axis-aligned box of a turned panel is
wider than the panel)."""

import os

import numpy as np
import pytest

pytest.importorskip("libero", reason="LIBERO is not installed (make libero)")


def _env(suite: str, task: int, init: int = 0):
    from dzmodel.eval.libero_env import check_libero, init_state, list_tasks

    check_libero()
    from libero.libero.envs import OffScreenRenderEnv

    spec = list_tasks(suite)[task]
    env = OffScreenRenderEnv(bddl_file_name=spec.bddl_file, has_offscreen_renderer=False, use_camera_obs=False)
    env.seed(0)
    env.reset()
    env.set_init_state(init_state(spec, init))
    return env


@pytest.fixture(scope="module", autouse=True)
def _mujoco_gl():
    os.environ.setdefault("MUJOCO_GL", "egl")


def test_only_the_microwave_is_an_enclosure():
    from dzmodel.eval.libero_enclosure import enclosure
    from dzmodel.eval.libero_expert import goal_terms

    for suite, task in (("goal", 3), ("10", 3), ("10", 0)):  # a closed drawer, an open drawer, the basket
        env = _env(suite, task)
        try:
            ins = [t[2] for t in goal_terms(env) if t[0] == "in"]
            assert ins and all(enclosure(env, region) is None for region in ins), (suite, task, ins)
        finally:
            env.close()
    env = _env("10", 9)
    try:
        box = enclosure(env, "microwave_1_heating_region")
        assert box is not None
        np.testing.assert_allclose(box.inward, [0.0, 1.0], atol=1e-6)  # in along +y, through the door's side
        assert abs(box.front - 0.269) < 0.01 and box.back > box.front + 0.15
        assert 0.93 < box.floor < 0.95 and 1.08 < box.ceiling < 1.10  # 14 cm high inside
        assert box.side_hi - box.side_lo > 0.2
    finally:
        env.close()


def test_the_doors_face_is_measured_on_the_panel_at_any_opening():
    from dzmodel.eval.libero_enclosure import DoorSkill
    from dzmodel.eval.libero_expert import quat_to_matrix

    faces, openings = [], []
    for init in (0, 1):  # the door open by about 90 and about 105 degrees
        env = _env("10", 9, init)
        try:
            obs, *_ = env.step(np.zeros(7))
            door = DoorSkill(env, "microwave_1", quat_to_matrix(obs["robot0_eef_quat"]))
            faces.append(door.face)
            openings.append(door.qpos())
            # the panel points away from the hinge along direction(q), and closing turns it away from outer(q)
            assert abs(float(np.dot(door.direction(door.qpos()), door.outer(door.qpos())))) < 1e-9
        finally:
            env.close()
    assert abs(openings[0] - openings[1]) > 0.2
    np.testing.assert_allclose(faces, [faces[0]] * 2, atol=0.002)  # the panel's thickness, whatever its angle
    assert 0.015 < faces[0] < 0.035
