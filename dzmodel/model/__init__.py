"""Model code: WAN DiT, VAEs, umT5, CLIP, the DreamZero WAM, its objective, the sampler and the policy."""
