"""TensorBoard event files in a job: written fast in its kernel, read and forwarded to MLflow by its runner.

A job's code logs with ``torch.utils.tensorboard.SummaryWriter`` and no MLflow
code; auto-logging (:mod:`danlu.autolog`) makes the writer write through
:mod:`~danlu.tensorboard.writer`, which batches the scalar records
(:mod:`~danlu.tensorboard.encoder`) and writes the same bytes TensorBoard
would. The job runner, a separate process, tails the files
(:mod:`~danlu.tensorboard.reader`) and sends the scalars to the job's MLflow
run (:mod:`~danlu.tensorboard.forwarder`) under MLflow-safe names
(:mod:`~danlu.tensorboard.names`). Both sides share the records' framing and
its CRC-32C checksums (:mod:`~danlu.tensorboard.format`).
"""
