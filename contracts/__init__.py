"""What every part of the system shares; needs only the standard library, numpy and safetensors."""
