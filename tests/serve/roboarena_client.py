"""A RoboArena evaluator client, written to behave exactly as robo-arena/roboarena's `policy_client.py` and
`scripts/test_policy_server.py` do (RoboArena is not on PyPI; this follows its source, not ours):

- connect to ws://host:port with compression off and no size limit, no auth header; on any failure (including
  a handshake frame that does not decode) try wss:// once;
- the first frame is the metadata, parsed as `PolicyServerConfig(**metadata)`: any extra key is a TypeError;
- `infer(obs)` adds `endpoint: "infer"`, sends msgpack-numpy (openpi_client's, byte-identical to RoboArena's),
  raises on a text reply; `reset(reset_info)` adds `endpoint: "reset"` and returns the raw reply;
- the test script sends one observation of zeros at `image_resolution` (288x512 if None), float32 state,
  `session_id` "38DSA3hd3" when asked for, and checks the reply is a dict whose `actions` is a 2-D ndarray with
  8 columns for joint action spaces, 7 otherwise.
"""

import dataclasses

import numpy as np
from openpi_client import msgpack_numpy
from websockets.sync.client import connect


@dataclasses.dataclass
class PolicyServerConfig:
    image_resolution: tuple[int, int] | None = (224, 224)
    needs_wrist_camera: bool = True
    n_external_cameras: int = 1
    needs_stereo_camera: bool = False
    needs_session_id: bool = False
    action_space: str = "joint_position"


class RoboArenaClient:
    def __init__(self, host: str = "0.0.0.0", port: int = 8000):
        try:
            self._ws, self._metadata = self._connect(f"ws://{host}:{port}")
        except Exception:  # noqa: BLE001 - RoboArena's client catches everything here, then tries TLS
            self._ws, self._metadata = self._connect(f"wss://{host}:{port}")

    @staticmethod
    def _connect(uri):
        ws = connect(uri, compression=None, max_size=None)
        return ws, msgpack_numpy.unpackb(ws.recv())

    def get_server_metadata(self):
        return self._metadata

    def infer(self, obs: dict):
        obs["endpoint"] = "infer"
        self._ws.send(msgpack_numpy.packb(obs))
        response = self._ws.recv()
        if isinstance(response, str):
            raise RuntimeError(f"Error in inference server:\n{response}")
        return msgpack_numpy.unpackb(response)

    def reset(self, reset_info: dict):
        reset_info["endpoint"] = "reset"
        self._ws.send(msgpack_numpy.packb(reset_info))
        return self._ws.recv()

    def close(self):
        self._ws.close()


def dummy_observation(config: PolicyServerConfig) -> dict:
    h, w = config.image_resolution if config.image_resolution is not None else (288, 512)
    obs = {}
    if config.needs_wrist_camera:
        obs["observation/wrist_image_left"] = np.zeros((h, w, 3), dtype=np.uint8)
        if config.needs_stereo_camera:
            obs["observation/wrist_image_right"] = np.zeros((h, w, 3), dtype=np.uint8)
    for i in range(config.n_external_cameras):
        obs[f"observation/exterior_image_{i}_left"] = np.zeros((h, w, 3), dtype=np.uint8)
        if config.needs_stereo_camera:
            obs[f"observation/exterior_image_{i}_right"] = np.zeros((h, w, 3), dtype=np.uint8)
    if config.needs_session_id:
        obs["session_id"] = "38DSA3hd3"
    obs["observation/joint_position"] = np.zeros((7,), dtype=np.float32)
    obs["observation/cartesian_position"] = np.zeros((6,), dtype=np.float32)
    obs["observation/gripper_position"] = np.zeros((1,), dtype=np.float32)
    obs["prompt"] = "test"
    return obs


def run_test_script(host: str, port: int, before_close=None) -> dict:
    """scripts/test_policy_server.py: metadata checks, one infer and its checks, then a reset. (The script itself
    calls `reset()` without the reset_info its own client requires; we pass {} as the client's __main__ does.)"""
    client = RoboArenaClient(host, port)
    metadata = client.get_server_metadata()
    assert isinstance(metadata, dict), f"metadata must be a dict, got {type(metadata)}"
    config = PolicyServerConfig(**metadata)
    assert config.n_external_cameras in [0, 1, 2]
    assert config.action_space in ["joint_position", "joint_velocity", "cartesian_position", "cartesian_velocity"]
    response = client.infer(dummy_observation(config))
    assert type(response) is dict and "actions" in response
    actions = response["actions"]
    assert isinstance(actions, np.ndarray) and len(actions.shape) == 2
    assert actions.shape[-1] == (8 if "joint" in config.action_space else 7)
    reset_reply = client.reset({})
    if before_close is not None:
        before_close()
    client.close()
    return {"config": config, "actions": actions, "reset_reply": reset_reply}
