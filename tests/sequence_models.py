"""The stateful models the sequence-batcher tests serve, written as Triton writes them."""

from __future__ import annotations

from pathlib import Path

from devtools import modelgen

# how long a sequence may go without a request before the server releases it. Triton's
# default is 1 s, which the gap between two requests of a test's sequence can exceed on
# a loaded machine (the next request then fails: no START). Only the idle-release test
# uses a short one, on purpose.
IDLE_US = 60_000_000

# Triton's config.pbtxt form: direct strategy, implicit state, a READY control
ACCUMULATOR_PBTXT = """\
name: "accumulator"
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: %(idle)d
  direct { }
  control_input [
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
  state [
    {
      input_name: "STATE_IN"
      output_name: "STATE_OUT"
      data_type: TYPE_INT32
      dims: [ 1 ]
      initial_state: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "zeros" }
    }
  ]
}
instance_group [ { count: %(instances)d kind: KIND_CPU } ]
"""

# the same model in config.yaml form with the oldest strategy
ACCUMULATOR_OLDEST_YAML = """\
backend: onnxruntime
max_batch_size: 4
input:
  - {name: INPUT, data_type: TYPE_INT32, dims: [1]}
output:
  - {name: OUTPUT, data_type: TYPE_INT32, dims: [1]}
sequence_batching:
  max_sequence_idle_microseconds: IDLE_US
  oldest:
    max_candidate_sequences: 4
    preferred_batch_size: [2, 4]
    max_queue_delay_microseconds: 2000
  control_input:
    - name: READY
      control: [{kind: CONTROL_SEQUENCE_READY, int32_false_true: [0, 1]}]
  state:
    - input_name: STATE_IN
      output_name: STATE_OUT
      data_type: TYPE_INT32
      dims: [1]
      initial_state: {data_type: TYPE_INT32, dims: [1], data_file: hundred, name: start}
""".replace("IDLE_US", str(IDLE_US))

# a Python model that returns the control values it was fed
CONTROLS_PBTXT = """\
name: "%(name)s"
backend: "python"
max_batch_size: 2
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "START_SEEN" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "END_SEEN" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "READY_SEEN" data_type: TYPE_BOOL dims: [ 1 ] },
  { name: "CORRID_SEEN" data_type: %(corrid_type)s dims: [ 1 ] },
  { name: "ROWS" data_type: TYPE_INT32 dims: [ 1 ] }
]
sequence_batching {
  max_sequence_idle_microseconds: %(idle)d
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: %(corrid_type)s } ] }
  ]
}
"""

CONTROLS_MODEL = """\
import numpy as np

from appliance import python_model as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            def get(name):
                return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

            rows = np.full((get("INPUT").shape[0], 1), get("INPUT").shape[0], np.int32)
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("START_SEEN", get("START")),
                        pb_utils.Tensor("END_SEEN", get("END")),
                        pb_utils.Tensor("READY_SEEN", get("READY")),
                        pb_utils.Tensor("CORRID_SEEN", get("CORRID")),
                        pb_utils.Tensor("ROWS", rows),
                    ]
                )
            )
        return responses
"""


def write_sequence_repository(repo: Path, idle_us: int = IDLE_US, instances: int = 1) -> Path:
    """A repository with ``accumulator`` (direct, pbtxt), ``accumulator_oldest``
    (oldest, YAML, initial state 100 from a file), ``controls`` (uint64 CORRID)
    and ``controls_string`` (string CORRID)."""
    acc = repo / "accumulator"
    (acc / "1").mkdir(parents=True)
    (acc / "1" / "model.onnx").write_bytes(modelgen.accumulator())
    (acc / "config.pbtxt").write_text(ACCUMULATOR_PBTXT % {"idle": idle_us, "instances": instances})
    oldest = modelgen.write_model(
        repo, "accumulator_oldest", modelgen.accumulator(), ACCUMULATOR_OLDEST_YAML
    )
    (oldest / "initial_state").mkdir()
    (oldest / "initial_state" / "hundred").write_bytes((100).to_bytes(4, "little"))
    for name, corrid_type in (("controls", "TYPE_UINT64"), ("controls_string", "TYPE_STRING")):
        folder = repo / name
        (folder / "1").mkdir(parents=True)
        (folder / "1" / "model.py").write_text(CONTROLS_MODEL)
        (folder / "config.pbtxt").write_text(
            CONTROLS_PBTXT % {"name": name, "corrid_type": corrid_type, "idle": idle_us}
        )
    return repo


# a Python model without implicit state that counts in the instance itself, as
# Triton's own sequence examples do: only correct if each sequence stays on one
# instance and its requests arrive in order
COUNTER_PBTXT = """\
name: "counter"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "INSTANCE" data_type: TYPE_INT32 dims: [ 1 ] }
]
sequence_batching {
  max_sequence_idle_microseconds: %(idle)d
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}
instance_group [ { count: 2 kind: KIND_CPU } ]
"""

COUNTER_MODEL = """\
import numpy as np

from appliance import python_model as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.instance = int(args["model_instance_name"].rsplit("_", 1)[1])
        self.totals = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            def get(name):
                return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

            corrid = int(get("CORRID")[0])
            if get("START")[0]:
                self.totals[corrid] = 0
            self.totals[corrid] += int(get("INPUT")[0])
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("COUNT", np.array([self.totals[corrid]], np.int32)),
                        pb_utils.Tensor("INSTANCE", np.array([self.instance], np.int32)),
                    ]
                )
            )
        return responses
"""

# variants that wait for full batches (10 s at most): only for the batching tests,
# where the requests that fill the batch are sent together
WAITING_DIRECT = """\
  direct { max_queue_delay_microseconds: 10000000 minimum_slot_utilization: 1.0 }
"""


def write_batching_repository(repo: Path) -> Path:
    """``controls_batched`` (direct, waits for both slots) and ``accumulator_pairs``
    (oldest, preferred batch size 2, waits up to 10 s for it)."""
    folder = repo / "controls_batched"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(CONTROLS_MODEL)
    text = CONTROLS_PBTXT % {
        "name": "controls_batched",
        "corrid_type": "TYPE_UINT64",
        "idle": IDLE_US,
    }
    (folder / "config.pbtxt").write_text(
        text.replace("sequence_batching {\n", "sequence_batching {\n" + WAITING_DIRECT)
    )
    pairs = ACCUMULATOR_OLDEST_YAML.replace(
        "preferred_batch_size: [2, 4]", "preferred_batch_size: [2]"
    ).replace("max_queue_delay_microseconds: 2000", "max_queue_delay_microseconds: 10000000")
    pairs = pairs.replace("data_file: hundred", "zero_data: true")
    modelgen.write_model(repo, "accumulator_pairs", modelgen.accumulator(), pairs)
    return repo


def write_counter(repo: Path) -> Path:
    folder = repo / "counter"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(COUNTER_MODEL)
    (folder / "config.pbtxt").write_text(COUNTER_PBTXT % {"idle": IDLE_US})
    return repo
