"""Running one model over several processes (torch.distributed): ``tp.py`` splits every layer's
weights (tensor parallelism), ``pp.py`` splits the layers into stages (pipeline parallelism), and
``workers.py`` starts the processes and keeps them in step."""
