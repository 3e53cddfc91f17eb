"""Expert-parallel row moves: the kernels on the device side of `mok.transport`'s exchanges.

push.py stores rows straight into peers' symmetric-memory buffers and waits for theirs (the one sync
pattern); dispatch.py packs rows into a send buffer and unpacks received ones, either side of an exchange.
"""
