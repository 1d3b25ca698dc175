"""rewrites that keep a checkpoint's layout: remap, the prefix commands, sets, DCP folders, torch.package archives."""
