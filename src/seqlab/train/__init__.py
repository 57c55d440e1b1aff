"""Training: the Trainer loop and its config, on the runtime floor (schedule, checkpoints, logbook, processes).

    from seqlab.train import TrainConfig, Trainer
    trainer = Trainer(TrainConfig(objective="clm", out_dir="runs/x"), model, objective, train_data, val_data, tokenizer)
    result = trainer.fit()
"""

from seqlab.runtime.errors import CheckpointError
from seqlab.train.config import TrainConfig, TrainConfigError
from seqlab.train.outcome import StopTraining, TrainingDiverged, TrainResult
from seqlab.train.trainer import Trainer

__all__ = ["CheckpointError", "StopTraining", "TrainConfig", "TrainConfigError", "TrainResult", "Trainer",
           "TrainingDiverged"]
