"""torch_ops"""
