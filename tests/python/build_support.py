"""What a build of tileattn covers. A build configured with fewer head-dim buckets
(TILEATTN_HEADDIMS) refuses larger head dims on CUDA with this message; tests treat that refusal
as "not built here" (a skip), never as a pass."""

NOT_BUILT = "head-dim bucket of this build"


def head_dim_not_built(exc: BaseException) -> bool:
    return isinstance(exc, NotImplementedError) and NOT_BUILT in str(exc)
