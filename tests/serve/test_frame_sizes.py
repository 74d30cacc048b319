"""Camera frames as labs have them: the frame sizes of common robot cameras are accepted and resized to the
model's view; the caps follow the bundle, with `dz serve` settings that raise them; and every refusal, an
oversized frame included, reaches openpi's client (PyPI 0.1.2, unchanged) as one message that names the limit
and the setting that raises it."""

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from dzmodel.cli import main
from dzmodel.data.embodiments import ServeSpec
from dzmodel.serve.protocol import CAMERA_PIXELS, RequestLimits, max_camera_pixels, parse_request
from dzmodel.serve.server import PolicyServer, ServerLimits, ServerThread

from .helpers import served_policy
from .test_real_clients import _free_port
from .test_server import DROID, DROID_DIMS, TOKEN, FakePolicy

CAMERAS = [(480, 640), (720, 1280), (1080, 1920), (1920, 1080)]  # VGA, 720p, 1080p, a 1080p camera on its side
DROID_IMAGES = ["observation/exterior_image_0_left", "observation/exterior_image_1_left",
                "observation/wrist_image_left"]


def droid_observation(shape, rng=None):
    """What RoboArena's and DreamZero's clients send, at camera frames of `shape` ((H, W) or (T, H, W))."""
    rng = rng or np.random.default_rng(0)
    obs = {k: rng.integers(0, 255, (*shape, 3), dtype=np.uint8) for k in DROID_IMAGES}
    return obs | {"observation/joint_position": np.zeros(7), "observation/gripper_position": np.zeros(1),
                  "prompt": "put the marker in the cup"}


def libero_observation(shape):
    img = np.zeros((*shape, 3), np.uint8)
    return {"observation/image": img, "observation/wrist_image": img, "observation/state": np.zeros(8),
            "prompt": "pick up the bowl"}


class SixCameras(FakePolicy):
    spec = ServeSpec(images={f"observation/cam_{i}": "image" for i in range(6)}, state={"observation/state": "state"})


@pytest.mark.parametrize("h, w", CAMERAS)
def test_frames_of_common_robot_cameras_parse(h, w):
    req = parse_request(droid_observation((h, w)), DROID, DROID_DIMS, RequestLimits())
    assert req.images["wrist"].shape == (1, h, w, 3)


def test_the_caps_follow_the_bundle_and_fit_one_1080p_frame_per_camera():
    assert max_camera_pixels(64 * 64) == CAMERA_PIXELS == 1920 * 1080     # never below a 1080p frame
    assert max_camera_pixels(720 * 1280) == 16 * 720 * 1280                # 4x the view per side, if more
    one_1080p = 1080 * 1920 * 3
    for limits in (ServerLimits(), ServerLimits(request=RequestLimits(max_frames=1))):
        server = PolicyServer(FakePolicy(), None, limits)
        assert server.request_limits.max_image_pixels == CAMERA_PIXELS
        assert server.frame_limits.max_bytes >= 2 * one_1080p               # two cameras, one 1080p frame each
        assert server.frame_limits.max_bytes <= 2 * 33 * 240 * 320 * 3 + (64 << 10)  # and bounded as before
    six = PolicyServer(SixCameras(), None).frame_limits.max_bytes
    assert six >= 6 * one_1080p > 32 << 20  # the default cap grows with the cameras: 1080p on each still fits
    raised = PolicyServer(FakePolicy(), None, ServerLimits(request=RequestLimits(max_image_pixels=3840 * 2160)))
    assert raised.request_limits.max_image_pixels == 3840 * 2160
    assert raised.frame_limits.max_bytes >= 2 * 3840 * 2160 * 3              # a 4K frame per camera fits
    assert PolicyServer(FakePolicy(), None, ServerLimits(max_frame_bytes=1 << 20)).frame_limits.max_bytes == 1 << 20


def test_a_max_image_pixels_that_refuses_every_frame_is_one_clear_error(droid_bundle, capsys, monkeypatch):
    monkeypatch.delenv("DZ_SERVE_TOKEN", raising=False)
    try:
        code = main(["serve", str(droid_bundle), "--no-auth", "--max-image-pixels", "10"])
    except SystemExit as exc:  # argparse
        code = exc.code
    assert code == 2 and "max_image_pixels must be at least 64 (a 8x8 image), got 10" in capsys.readouterr().err


def test_openpi_client_gets_chunks_for_camera_frames_of_common_sizes(droid_bundle):
    """Frames of 480x640 to 1080x1920 from each of DROID's three cameras, resized to the model's view by the
    policy's own transform (as in training)."""
    with ServerThread(served_policy(droid_bundle), TOKEN) as srv:
        client = WebsocketClientPolicy("127.0.0.1", srv.port, api_key=TOKEN)
        for h, w in CAMERAS:
            actions = client.infer(droid_observation((h, w)) | {"session_id": f"{h}x{w}"})["actions"]
            assert actions.shape == (24, 8) and np.isfinite(actions).all()


def test_openpi_client_reads_a_frame_over_the_pixel_cap_as_one_message(libero_bundle):
    """Decoded, then refused (1008): openpi's client raises the server's one-line reason."""
    with ServerThread(served_policy(libero_bundle), TOKEN) as srv:
        client = WebsocketClientPolicy("127.0.0.1", srv.port, api_key=TOKEN)
        with pytest.raises(RuntimeError, match=r"^Error in inference server:\nbad request: observation/image: a "
                                               r"1100x1920 image has 2,112,000 pixels, over this server's limit of "
                                               r"2,073,600 per camera frame; .*\(dz serve --max-image-pixels\)$"):
            client.infer(libero_observation((1100, 1920)))


def test_openpi_client_reads_a_frame_over_the_byte_limit_as_one_message(libero_bundle):
    """Refused from the frame's header, before any of it is kept (1009), yet openpi's client, which reads
    nothing until it has sent the whole frame, raises the server's one-line reason (not a reset)."""
    with ServerThread(served_policy(libero_bundle), TOKEN) as srv:
        limit = srv.server.frame_limits.max_bytes
        client = WebsocketClientPolicy("127.0.0.1", srv.port, api_key=TOKEN)
        assert 2 * 2 * 1080 * 1920 * 3 > limit  # two 1080p frames per camera: over the limit that 33 frames give
        with pytest.raises(RuntimeError, match=rf"^Error in inference server:\nframe too big: [\d,]+ bytes, over "
                                               rf"this server's limit of {limit:,} bytes; .*\(dz serve --max-image-pixels "
                                               r"for larger camera frames, --max-frames for more of them\)$"):
            client.infer(libero_observation((2, 1080, 1920)))
        client = WebsocketClientPolicy("127.0.0.1", srv.port, api_key=TOKEN)  # the server carries on
        assert client.infer(libero_observation((1080, 1920)))["actions"].shape == (16, 7)
    with ServerThread(served_policy(libero_bundle), TOKEN, limits=ServerLimits(max_frame_bytes=8 << 20)) as srv:
        client = WebsocketClientPolicy("127.0.0.1", srv.port, api_key=TOKEN)
        with pytest.raises(RuntimeError, match=r"^Error in inference server:\nframe too big: .* limit of 8,388,608 "
                                               r"bytes; .*\(dz serve --max-frame-mib\)$"):
            client.infer(libero_observation((1080, 1920)))


def _wait_for_port(port: int, server: subprocess.Popen, timeout_s: float = 180) -> None:
    """Until the server listens (openpi's client itself waits forever, 5 s a try)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and server.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    pytest.fail("the server did not come up")


def test_dz_serve_settings_raise_the_caps_and_openpi_client_reads_the_refusals(droid_bundle):
    """`dz serve` itself: --max-image-pixels and --max-frame-mib set the caps, which the refusals name."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "dzmodel.cli", "serve", str(droid_bundle), "--no-auth", "--port",
                               str(port), "--solver-steps", "1", "--cfg-scale", "1", "--max-image-pixels", "1000000",
                               "--max-frame-mib", "20"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, env=env)
    try:
        _wait_for_port(port, server)
        client = WebsocketClientPolicy("127.0.0.1", port)
        assert client.infer(droid_observation((720, 1280)))["actions"].shape == (24, 8)
        with pytest.raises(RuntimeError, match=r"limit of 1,000,000 per camera frame; .*dz serve --max-image-pixels"):
            client.infer(droid_observation((1080, 1920)))
        client = WebsocketClientPolicy("127.0.0.1", port)
        with pytest.raises(RuntimeError, match=r"frame too big: .* limit of 20,971,520 bytes; .*--max-frame-mib"):
            client.infer(droid_observation((4, 720, 1280)))  # 33 MB
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        log = server.communicate(timeout=30)[0]
    assert "limits: camera frames up to 1,000,000 pixels (--max-image-pixels), requests up to 20.0 MiB" in log
    assert "refused: frame too big: " in log and "(1009)" in log and "Traceback" not in log
