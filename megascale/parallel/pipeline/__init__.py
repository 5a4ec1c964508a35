"""Pipeline parallelism: stages (stage.py), schedules as op lists (schedule.py), their point-to-point
messages (comm.py) and the one loop that runs any schedule (step.py).

    stage = PipelineStage(cfg.model, mesh, cfg.parallel.vpp, factory)
    result = pipeline_step(stage, microbatches, micro_batch, schedule)   # forwards + backwards
"""

from megascale.parallel.pipeline.schedule import (
    SCHEDULES,
    Op,
    Prefetch,
    recv_plan,
    schedule_ops,
    simulate,
    theoretical_bubble,
)
from megascale.parallel.pipeline.stage import (
    PipelineStage,
    check_pipeline,
    default_schedule,
    gather_stage_state_dict,
    load_stage_state_dict,
    num_microbatches,
    partition,
    rank_chunks,
)
from megascale.parallel.pipeline.step import StepResult, activation_shape, pipeline_step

__all__ = [
    "SCHEDULES",
    "Op",
    "PipelineStage",
    "Prefetch",
    "StepResult",
    "activation_shape",
    "check_pipeline",
    "default_schedule",
    "gather_stage_state_dict",
    "load_stage_state_dict",
    "num_microbatches",
    "partition",
    "pipeline_step",
    "rank_chunks",
    "recv_plan",
    "schedule_ops",
    "simulate",
    "theoretical_bubble",
]
