"""Training: EAGLE-3 heads for a given target (with training-time test), DFlash block
drafters (the block-diffusion objective), and the small from-scratch models of the bundle
(tokenizer, target, standalone draft)."""
from jspec.train.dflash import DFlashTrainConfig, block_loss, train_dflash
from jspec.train.eagle3 import Eagle3TrainConfig, train_eagle3, ttt_logits, ttt_loss
from jspec.train.lm import train_lm

__all__ = ["DFlashTrainConfig", "Eagle3TrainConfig", "block_loss", "train_dflash", "train_eagle3", "train_lm",
           "ttt_logits", "ttt_loss"]
