"""Running one model over several processes (torch.distributed): ``tp.py`` splits the layers and
weights (tensor parallelism), ``workers.py`` starts the processes and keeps them in step."""
