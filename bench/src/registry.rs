//! The registry section: pulling a ~100 MB image (built here from busybox and noise, pushed to
//! Debian's docker-registry on loopback) through `silk-registry`, beside `skopeo copy` of the same
//! image to a local directory (the floor: the same blobs fetched and their digests checked); and a
//! second node's pull, which takes the blobs from the store instead of the registry.

use std::sync::Arc;
use std::time::{Duration, Instant};

use silk_registry::{LayerCache, Progress, Puller, RegistrySettings, Settings};
use silk_store::ObjectStore;
use silk_store::fs::{FsConfig, FsStore};
use silk_testkit::registry::{Auth, Registry};

use crate::report::{Samples, host_stamp, ms, table};

#[derive(Debug, clap::Args)]
pub struct RegistryArgs {
    /// Noise in the image, MiB (in four files: four layers' worth of data in one layer).
    #[arg(long, default_value_t = 96)]
    size_mib: usize,
    /// Runs of each arm (the table shows the median).
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

const MIB: usize = 1 << 20;

pub fn run(args: RegistryArgs) -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let work = tempfile::tempdir()?;
    let registry = Registry::start("127.0.0.66", Auth::Anonymous);
    let archive = work.path().join("big.tar");
    let quarter = args.size_mib * MIB / 4;
    let noise: Vec<(String, Vec<u8>)> = (0..4)
        .map(|i| {
            let mut data = vec![0; quarter];
            blake3::Hasher::new().update(&[i]).finalize_xof().fill(&mut data);
            (format!("/noise/{i}"), data)
        })
        .collect();
    let extra: Vec<(&str, Vec<u8>)> = noise.iter().map(|(p, d)| (p.as_str(), d.clone())).collect();
    silk_testkit::images::busybox_archive(&archive, "bench", &extra);
    let digest = registry.push_archive(&archive, "big:v1", false);
    let reference = format!("{}/big:v1", registry.host());
    let bytes = (args.size_mib * MIB) as u64;
    println!(
        "## registry\n\n{}\nimage: {} MiB of noise, one gzip layer\n",
        host_stamp(),
        args.size_mib
    );

    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let settings = Settings {
        registries: [(registry.host(), RegistrySettings { insecure: true, ..Default::default() })]
            .into(),
        max_image_bytes: u64::MAX,
        ..Default::default()
    };
    let digest = silk_registry::Digest::parse(&digest)?;
    let store_dir = work.path().join("store");
    let open_store = || -> anyhow::Result<Arc<dyn ObjectStore>> {
        let _ = std::fs::remove_dir_all(&store_dir);
        let cfg = FsConfig { fsync: false, ..FsConfig::new(&store_dir) };
        Ok(Arc::new(runtime.block_on(FsStore::open(cfg))?))
    };
    // One pull into a fresh layer cache, from `store` (when given) or the registry; with
    // `unpack`, also its layers unpacked, as a template's import does, and `tar -xzf` of the
    // same blobs beside it.
    let pull = |store: Option<Arc<dyn ObjectStore>>,
                n: usize,
                unpack: Option<(&mut Samples, &mut Samples)>|
     -> anyhow::Result<(Duration, u32)> {
        let cache_dir = work.path().join(format!("cache-{n}"));
        let cache = LayerCache::open(&cache_dir, u64::MAX, 0)?;
        let puller = Puller::new(settings.clone(), cache, store);
        let t0 = Instant::now();
        let pulled = runtime.block_on(puller.pull(&reference, &digest, &Progress::default()))?;
        let took = t0.elapsed();
        if let Some((ours, tar)) = unpack {
            let root = work.path().join("unpacked");
            let t0 = Instant::now();
            for l in &pulled.layers {
                let file = std::fs::File::open(&l.path)?;
                let plain = silk_engine::layer::decompress(file)?;
                let ids = silk_engine::layer::Ids::HOST;
                silk_engine::layer::apply(
                    plain,
                    &root,
                    silk_engine::layer::Whiteouts::Delete,
                    ids,
                )?;
            }
            ours.push(t0.elapsed());
            std::fs::remove_dir_all(&root)?;
            std::fs::create_dir(&root)?;
            let t0 = Instant::now();
            for l in &pulled.layers {
                let ok = std::process::Command::new("tar")
                    .args(["-xzf"])
                    .arg(&l.path)
                    .arg("-C")
                    .arg(&root)
                    .status()?
                    .success();
                anyhow::ensure!(ok, "tar -xzf failed");
            }
            tar.push(t0.elapsed());
            std::fs::remove_dir_all(&root)?;
        }
        std::fs::remove_dir_all(&cache_dir)?;
        Ok((took, pulled.sources.registry))
    };

    let (mut floor, mut bare, mut shared, mut from_store) =
        (Samples::default(), Samples::default(), Samples::default(), Samples::default());
    let (mut unpack, mut untar) = (Samples::default(), Samples::default());
    let mut n = 0;
    for _ in 0..args.runs {
        let out = work.path().join("skopeo-dir");
        let t0 = Instant::now();
        let status = std::process::Command::new("skopeo")
            .args(["copy", "--quiet", "--insecure-policy", "--src-tls-verify=false"])
            .arg(format!("docker://{reference}"))
            .arg(format!("dir:{}", out.display()))
            .status()?;
        floor.push(t0.elapsed());
        anyhow::ensure!(status.success(), "skopeo copy failed");
        std::fs::remove_dir_all(&out)?;
        n += 1;
        bare.push(pull(None, n, Some((&mut unpack, &mut untar)))?.0);
        // A first node: from the registry, each blob then put in the (emptied) store.
        let store = open_store()?;
        n += 1;
        shared.push(pull(Some(store.clone()), n, None)?.0);
        // A second node: every blob from the store.
        let gets = registry.blob_gets().len();
        n += 1;
        let (took, from_registry) = pull(Some(store), n, None)?;
        anyhow::ensure!(from_registry == 0 && registry.blob_gets().len() == gets);
        from_store.push(took);
    }
    let floor_p50 = floor.pct(0.5);
    let row = |what: &str, s: &Samples| {
        let p50 = s.pct(0.5);
        vec![
            what.to_string(),
            ms(p50),
            format!("{:.0}", bytes as f64 / MIB as f64 / p50.as_secs_f64()),
            format!("{:.2}×", p50.as_secs_f64() / floor_p50.as_secs_f64()),
        ]
    };
    table(
        "Image pull (p50 of each arm; × the floor's p50)",
        &["arm", "p50 ms", "MiB/s", "× floor"],
        &[
            row("floor: skopeo copy docker:// → dir:", &floor),
            row("silk-registry pull, no store", &bare),
            row("first node: registry → cache, shared to the store", &shared),
            row("second node: store → cache (no registry blob GET)", &from_store),
        ],
    );
    let untar_p50 = untar.pct(0.5);
    table(
        "Unpacking the pulled layer (p50; × the floor's p50)",
        &["arm", "p50 ms", "× floor"],
        &[
            vec!["floor: tar -xzf".into(), ms(untar_p50), "1.00×".into()],
            vec![
                "layer::decompress + layer::apply (as a template import)".into(),
                ms(unpack.pct(0.5)),
                format!("{:.2}×", unpack.pct(0.5).as_secs_f64() / untar_p50.as_secs_f64()),
            ],
        ],
    );
    Ok(())
}
