"""The two one-thread kernels that set a conditional node's condition on the device.

PTX, loaded by the driver at first use (``cuModuleLoadData``), so no compiler is needed and
nothing is written to disk. Each calls the device-runtime function ``cudaGraphSetConditional``
(CUDA 12.4+), which the driver resolves when it loads the module.
"""

from __future__ import annotations

__all__ = ["BRANCH", "LOOP", "PTX"]

LOOP = "cudagraphs_loop_condition"
BRANCH = "cudagraphs_branch_condition"

# Two kernels, one thread each. loop: count += 1; condition = flag != 0 and count <= limit.
# branch: condition = (flag != 0) != negate. `flag` is a 0-dim bool tensor (one byte).
PTX = r"""
.version 7.8
.target sm_70
.address_size 64

.extern .func cudaGraphSetConditional(.param .b64 handle, .param .b32 value);

.visible .entry cudagraphs_loop_condition(
    .param .u64 flag_address,
    .param .u64 count_address,
    .param .u32 limit,
    .param .u64 handle
)
{
    .reg .pred %go<3>;
    .reg .b16 %flag;
    .reg .b32 %n<4>;
    .reg .b64 %a<4>;

    ld.param.u64 %a0, [flag_address];
    ld.param.u64 %a1, [count_address];
    ld.param.u32 %n0, [limit];
    ld.param.u64 %a2, [handle];
    cvta.to.global.u64 %a0, %a0;
    cvta.to.global.u64 %a1, %a1;
    ld.global.u8 %flag, [%a0];
    ld.global.u32 %n1, [%a1];
    add.u32 %n1, %n1, 1;
    st.global.u32 [%a1], %n1;
    setp.ne.u16 %go0, %flag, 0;
    setp.le.u32 %go1, %n1, %n0;
    and.pred %go2, %go0, %go1;
    selp.u32 %n2, 1, 0, %go2;
    {
        .param .b64 handle_arg;
        .param .b32 value_arg;
        st.param.b64 [handle_arg], %a2;
        st.param.b32 [value_arg], %n2;
        call.uni cudaGraphSetConditional, (handle_arg, value_arg);
    }
    ret;
}

.visible .entry cudagraphs_branch_condition(
    .param .u64 flag_address,
    .param .u32 negate,
    .param .u64 handle
)
{
    .reg .pred %go<3>;
    .reg .b16 %flag;
    .reg .b32 %n<3>;
    .reg .b64 %a<3>;

    ld.param.u64 %a0, [flag_address];
    ld.param.u32 %n0, [negate];
    ld.param.u64 %a1, [handle];
    cvta.to.global.u64 %a0, %a0;
    ld.global.u8 %flag, [%a0];
    setp.ne.u16 %go0, %flag, 0;
    setp.ne.u32 %go1, %n0, 0;
    xor.pred %go2, %go0, %go1;
    selp.u32 %n1, 1, 0, %go2;
    {
        .param .b64 handle_arg;
        .param .b32 value_arg;
        st.param.b64 [handle_arg], %a1;
        st.param.b32 [value_arg], %n1;
        call.uni cudaGraphSetConditional, (handle_arg, value_arg);
    }
    ret;
}
"""
