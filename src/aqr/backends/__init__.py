"""The fast recalibration path: aqr's C kernels on CPU and a torch implementation everywhere."""
