"""The torch training loop shared by pretraining and fine-tuning: step, schedule, checkpoint, metrics."""
