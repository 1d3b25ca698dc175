"""scan: a checkpoint's globals, code and byte layout rated safe / needs-trust / dangerous."""
