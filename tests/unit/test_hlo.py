"""Reading a compiled program's collectives from its HLO text (engine/plan/hlo.py)."""

import pytest

from engine.plan import hlo

pytestmark = pytest.mark.nocompile


# A loop of 4 iterations whose body holds a custom call with a backend config broken over lines
# (as the TPU compiler prints splash attention's Mosaic kernel), then an all-gather.
PROGRAM = """HloModule jit_step

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8] get-tuple-element(%p), index=1
  %kernel = f32[8] custom-call(%x), custom_call_target="tpu_custom_call", backend_config={"a":"{\\"block_q\\": 128
}}, metadata={op_name="splash"}
  %gathered = f32[64] all-gather(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8]) tuple(%i, %kernel)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8] parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]) tuple(%zero, %x)
  %loop = (s32[], f32[8]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8] get-tuple-element(%loop), index=1
}
"""


def test_a_collective_after_a_multiline_custom_call_counts_once_per_loop_iteration():
    found = hlo.program_collectives(PROGRAM, 8)
    assert [(c.op, c.count, c.bytes) for c in found] == [("all-gather", 4, 64 * 4)]
