"""The CAM window-mode constants, named and valued as in the seed (000, "HCCL Window 模式 代码深度剖析").

Sections follow the seed's constant tables (its section 9); where a value comes from the CAM C++ sources and not
from the seed, the comment says so. ``KB`` and ``MB`` are binary (the seed writes ``500UL * 1024UL``).
"""

from __future__ import annotations

KB = 1024
MB = 1024 * 1024

# --- 9.1 window layout -----------------------------------------------------------------------------------------
NOTIFY_DISPATCH_BUFF_OFFSET = 204 * MB  # comm_args.h: notify_dispatch area at the start of each In-window half
NOTIFY_DISPATCH_WIN_OFFSET = 204 * MB  # the host tiling's name for the same value (window-size check)
IPC_BUFF_MAX_SIZE = 100 * MB  # SHMEM mode only; not used by the window path
IPC_DATA_OFFSET = 2 * MB  # SHMEM mode only ("2MB flag + 100MB data"); not used
WIN_STATE_OFFSET = 500 * KB  # distance between the two dispatch flag areas in the Exp window
STATE_WIN_OFFSET = 950 * KB  # per-block dataState words in the local Exp window
WIN_ADDR_ALIGN = 512  # dispatch row rounding, dataState slot stride
COMBINE_STATE_WIN_OFFSET = 4 * MB  # combine flag area (at +204 MB); the combine data area follows it
MAGIC_WIN_OFFSET = 975 * KB  # per-block combine magic words in the local Exp window
STATE_OFFSET = 32  # one dispatch flag slot: "32B per expert"

# --- 9.2 alignment ---------------------------------------------------------------------------------------------
UB_ALIGN = 32  # token payload rounding inside a dispatch row
UB_32_ALIGN = 32  # one combine flag slot per (token, topk)
MUL_256_ALIGN = 256  # UB fp32 buffer rounding (no effect on results)
WIN_512_ALIGN = 512  # combine row rounding, magic slot stride
FLOAT_NUM_PER_ALIGN = 8  # float32 values per 32 B flag slot

# --- 9.3 buffers and records -----------------------------------------------------------------------------------
BUFFER_NUM = 2  # UB double buffering (no semantic effect)
DOUBLE_BUFFER = 2
EXPAND_IDX_INFO = 3  # int32 per (rank, token, topk) triple in a dispatch row and in expandIdxOut
TOKEN_SRC_INFO_LEN = 3  # the same triple as combine reads it
RANK_ID_OFFSET_IN_SRC_INFO = 0
TOKEN_IDX_OFFSET_IN_SRC_INFO = 1
TOPK_IDX_OFFSET_IN_SRC_INFO = 2

# --- 9.4 communication -----------------------------------------------------------------------------------------
COMM_NUM = 2  # communication domains: EP and TP
COMM_EP_IDX = 0
COMM_TP_IDX = 1
CAM_MAX_RANK_SIZE = 384
MAX_EP_WORLD_SIZE = 384
MAX_TP_WORLD_SIZE = 2
MIN_EP_WORLD_SIZE = 2  # CAM sources: epWorldSize in [2, 384]

# --- 9.5 sync (sync_collectives.h Magic+Value; these two kernels use float 1.0f flags instead) ------------------
MAGIC_OFFSET = 32
MAGIC_MASK = ~((1 << MAGIC_OFFSET) - 1) & 0xFFFF_FFFF_FFFF_FFFF
FLAG_UNIT_INT_NUM = 4
SYNC_UNIT_SIZE = 32
CYCLE_TO_TIME = 50  # system-counter cycles per microsecond (50 MHz)

# --- 9.6 limits ------------------------------------------------------------------------------------------------
MOE_EXPERT_MAX_NUM = 512
K_MAX = 16
H_MIN = 1024
H_MAX = 7168
BS_UPPER_BOUND = 8000
DISPATCH_STATUS_MAX_SUPPORT_NUM = 1280

# --- host tiling (seed 3.3, 8.2, 8.5) --------------------------------------------------------------------------
TILINGKEY_NO_QUANT = 10000
TILINGKEY_QUANT = 10002
QUANT_MODE_NONE = 0
QUANT_MODE_DYNAMIC = 2
DOUBLE_DATA_BUFFER = 2
MB_SIZE = MB
SCALE_EXPAND_IDX_BUFFER = 44  # "h*2 + scale(32B) + triple(12B)" in tokenActualLen
MAX_OUT_DTYPE_SIZE = 2  # the tiling assumes 2 B per element (the seed writes h * 2)
SYSTEM_NEED_WORKSPACE = 16 * MB
WORKSPACE_ELEMENT_OFFSET = 512
HCCL_BUFFSIZE_DEFAULT_MB = 200  # seed section 2; note that it can never pass the window check (README, A10)
ALG_CONFIG_DISPATCH = ("AlltoAll=level0:fullmesh;level1:pairwise", "AllGather=level0:ring")
ALG_CONFIG_COMBINE = ("AlltoAll=level0:fullmesh;level1:pairwise", "ReduceScatter=level0:ring")

# --- emulator choices (README "ambiguities") -------------------------------------------------------------------
WIN_EXP_SIZE = 1 * MB  # winExpSize is not given by the seed (A11)
MAX_AIV_NUM = (MAGIC_WIN_OFFSET - STATE_WIN_OFFSET) // WIN_ADDR_ALIGN  # 50 dataState slots fit before the magic
FLAG_ONE_BITS = 0x3F800000  # 1.0f


def ceil_div(a: int, b: int) -> int:
    """AscendC ``Ceil``: the integer ceiling of ``a / b``."""
    return (a + b - 1) // b


def align_up(a: int, b: int) -> int:
    """``Ceil(a, b) * b``: ``a`` rounded up to a multiple of ``b``."""
    return ceil_div(a, b) * b
