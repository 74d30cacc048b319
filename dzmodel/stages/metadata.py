"""The metadata stage: the embodiment's normalisation statistics, from the training episodes only."""

from __future__ import annotations

from ..config import Profile, StagePaths, train_config
from .common import Log, fresh_dir, print_line, write_csv


def stage_metadata(prof: Profile, paths: StagePaths, log: Log = print_line) -> dict:
    from ..data.dataset import embodiment_metadata
    from ..data.embodiments import get_embodiment, load_embodiments

    m = prof.metadata
    emb = get_embodiment(m.embodiment, load_embodiments([str(paths.root / f) for f in m.embodiment_files]))
    out = fresh_dir(paths.metadata.parent)
    # the statistics leave out the episodes training holds out, so the held-out evaluation stays unseen
    heldout = train_config(prof, paths).heldout_episodes
    doc = embodiment_metadata(paths.dataset, emb, paths.metadata, max_episodes=m.max_episodes, heldout_episodes=heldout)
    rows = []
    for group, entries in doc[emb.tag]["statistics"].items():
        for key, st in entries.items():
            for i in range(len(st["mean"])):
                rows.append({"group": group, "key": key, "dim": i, "mean": round(st["mean"][i], 5),
                             "std": round(st["std"][i], 5), "q01": round(st["q01"][i], 5), "q99": round(st["q99"][i], 5)})
    write_csv(out / "statistics.csv", rows)
    entry = doc[emb.tag]
    log(f"metadata: {paths.metadata} [{emb.tag}], {len(rows)} normalised dims, from {entry['statistics_episodes']} "
        f"episodes (held out: {entry['heldout_episodes'] or 'none'})")
    return {"metadata": str(paths.metadata), "embodiment": emb.tag, "statistics": rows,
            "statistics_episodes": entry["statistics_episodes"], "heldout_episodes": entry["heldout_episodes"]}

