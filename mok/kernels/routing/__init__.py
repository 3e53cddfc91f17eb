"""Routing: rows between token order and the expert-sorted, tile-padded layout the grouped GEMMs run over.

schedule.py builds the layout on the device (which row each route takes), gather.py copies token rows
into it (the backward's operands, the forward's sorted x), combine.py sums each token's route outputs back.
"""
