//! The parts of `e2e/kind/` (issue 6: kind with GPUs) that can be checked without Docker or a
//! GPU, so that they cannot rot between the runs on machines that have them:
//! - every manifest the kind scripts apply, and the device plugin, pass the local cluster's API
//!   server in a server-side dry run (the TrainingJob CRD's schema and CEL rules included);
//! - the chart renders with `values-kind.yaml`, passes `helm lint`, and what it renders passes
//!   the API server too; the values name only keys the chart has;
//! - the kind config gives each worker node the GPUs (and the label the device plugin selects);
//! - every TrainingJob asks for `nvidia.com/gpu`, trains with `device: cuda`, fits its world size
//!   and names the worker image that `up.sh` builds.
//!
//! The dry run needs the cluster of `make e2e` (TENSORFLEET_E2E_CLUSTER); the other checks read
//! files only.

use k8s_openapi::serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Output;
use tensorfleet_e2e::{repo, Cluster};
use tensorfleet_operator::crd::TrainingJob;

/// The worker and operator images `up.sh` builds: tagged with the workspace version, as `make
/// images` tags them (this crate's version is the workspace's).
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The GPU mount of a kind node: the host's NVIDIA runtime gives the node container every GPU.
const GPU_MOUNT: (&str, &str) = ("/dev/null", "/var/run/nvidia-container-devices/all");

fn kind_dir() -> PathBuf {
    repo().join("e2e/kind")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The YAML documents of `text` as JSON values, empty ones left out.
fn documents(text: &str, origin: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{origin}: not YAML: {e}")))
        .filter(|v| !v.is_null())
        .collect()
}

fn file_documents(path: &Path) -> Vec<Value> {
    documents(&read(path), &path.display().to_string())
}

/// The manifests the kind scripts apply as they are (`e2e/kind/manifests/*.yaml`), sorted.
fn manifests() -> Vec<PathBuf> {
    let dir = kind_dir().join("manifests");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no manifests in {}", dir.display());
    files
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// helm from the control plane's binaries, which the cluster's env file names (as it does
/// kubectl's).
fn helm(cluster: &Cluster, args: &[&str]) -> Output {
    let env_file = cluster.dir.join("env");
    let env = read(&env_file);
    let bin = env
        .lines()
        .find_map(|l| l.strip_prefix("TENSORFLEET_K8S_BIN="))
        .unwrap_or_else(|| panic!("{} names no TENSORFLEET_K8S_BIN", env_file.display()));
    std::process::Command::new(Path::new(bin).join("helm"))
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap_or_else(|e| panic!("running {bin}/helm: {e}"))
}

/// `kubectl apply --dry-run=server` of `args`' objects into `ns`: every object must be
/// accepted, and there must be `objects` of them (a dry run of nothing proves nothing).
fn dry_run(cluster: &Cluster, ns: &str, what: &str, args: &[&str], stdin: Option<&str>, objects: usize) {
    let mut all = vec!["apply", "--dry-run=server", "-n", ns];
    all.extend_from_slice(args);
    let out = cluster.kubectl(&all, stdin);
    assert!(out.status.success(), "the API server refused {what}:\n{}", text(&out));
    let accepted = String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.ends_with("(server dry run)")).count();
    assert_eq!(accepted, objects, "{what}: {objects} objects, {accepted} accepted:\n{}", text(&out));
}

/// (a) and (b): what the kind scripts apply, and the chart with their values, pass the API
/// server of the local cluster, which has the TrainingJob CRD (installed by helm).
#[tokio::test]
#[ignore = "needs the local cluster of `make e2e` (TENSORFLEET_E2E_CLUSTER)"]
async fn kind_manifests_and_the_chart_with_kind_values_pass_the_api_server() {
    let cluster = Cluster::connect().await;
    let ns = cluster.namespace("kind-manifests").await;

    let mut files = manifests();
    // up.sh applies it with -n kube-system; it names no namespace, so it goes into ns here.
    files.push(kind_dir().join("device-plugin.yaml"));
    for file in &files {
        let objects = file_documents(file).len();
        let path = file.to_str().expect("a UTF-8 path");
        dry_run(&cluster, &ns, path, &["-f", path], None, objects);
    }

    // The chart as up.sh installs it, rendered under another release name so that nothing
    // collides with the local cluster's own operator.
    let values = kind_dir().join("values-kind.yaml");
    let values = values.to_str().expect("a UTF-8 path");
    let image_tag = format!("image.tag={VERSION}");
    let worker_tag = format!("workerImage.tag={VERSION}");
    let lint = helm(&cluster, &["lint", "--strict", "charts/tensorfleet", "-f", values]);
    assert!(lint.status.success(), "helm lint with {values}:\n{}", text(&lint));
    let rendered = helm(
        &cluster,
        &[
            "template",
            "kind-check",
            "charts/tensorfleet",
            "--namespace",
            &ns,
            "-f",
            values,
            "--set",
            &image_tag,
            "--set",
            &worker_tag,
        ],
    );
    assert!(rendered.status.success(), "helm template with {values}:\n{}", text(&rendered));
    let rendered = String::from_utf8(rendered.stdout).expect("helm's output is UTF-8");
    let objects = documents(&rendered, "helm template");
    let deployment = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .unwrap_or_else(|| panic!("helm template rendered no Deployment:\n{rendered}"));
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["image"], json!(format!("tensorfleet/operator:{VERSION}")), "{container}");
    assert_eq!(container["imagePullPolicy"], "Never", "kind loads the image; nothing may pull it: {container}");
    dry_run(&cluster, &ns, "the chart rendered with values-kind.yaml", &["-f", "-"], Some(&rendered), objects.len());

    cluster.delete_namespace(&ns).await;
}

/// (c) Each worker node of the kind cluster gets the host's GPUs and the label the device
/// plugin's DaemonSet selects; the control plane gets neither. All nodes run one node image,
/// pinned by digest, and the scripts' default cluster name is the config's.
#[test]
fn the_kind_config_gives_every_worker_node_the_gpus() {
    let path = kind_dir().join("kind-config.yaml");
    let config: Value = serde_yaml::from_str(&read(&path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(config["kind"], "Cluster");
    assert_eq!(config["apiVersion"], "kind.x-k8s.io/v1alpha4");
    let nodes = config["nodes"].as_array().expect("nodes");
    let role = |r: &str| nodes.iter().filter(|n| n["role"] == r).collect::<Vec<_>>();
    let (control_planes, workers) = (role("control-plane"), role("worker"));
    assert_eq!(control_planes.len(), 1, "one control plane: {nodes:?}");
    assert_eq!(workers.len(), 2, "two GPU workers: {nodes:?}");
    assert_eq!(control_planes.len() + workers.len(), nodes.len(), "only control-plane and worker roles: {nodes:?}");

    let mounts = |node: &Value| -> Vec<(String, String)> {
        node["extraMounts"]
            .as_array()
            .map(|ms| {
                ms.iter()
                    .map(|m| {
                        let field = |k: &str| m[k].as_str().unwrap_or_default().to_string();
                        (field("hostPath"), field("containerPath"))
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let gpu_mount = (GPU_MOUNT.0.to_string(), GPU_MOUNT.1.to_string());
    for (i, worker) in workers.iter().enumerate() {
        assert!(mounts(worker).contains(&gpu_mount), "worker {i} has no GPU mount {GPU_MOUNT:?}: {worker}");
    }
    assert!(
        !mounts(control_planes[0]).iter().any(|(_, c)| c.starts_with("/var/run/nvidia-container-devices")),
        "the control plane must not take GPUs: {}",
        control_planes[0]
    );

    // The device plugin runs where the GPUs are: its nodeSelector is every worker's label.
    let plugin = file_documents(&kind_dir().join("device-plugin.yaml"));
    assert_eq!(plugin.len(), 1, "device-plugin.yaml: one DaemonSet");
    assert_eq!(plugin[0]["kind"], "DaemonSet");
    assert!(
        plugin[0]["metadata"].get("namespace").is_none(),
        "device-plugin.yaml must name no namespace (up.sh gives it)"
    );
    let selector = plugin[0]["spec"]["template"]["spec"]["nodeSelector"].as_object().expect("a nodeSelector");
    assert!(!selector.is_empty());
    for (key, value) in selector {
        for worker in &workers {
            assert_eq!(&worker["labels"][key], value, "worker lacks the device plugin's node label {key}: {worker}");
        }
        assert!(control_planes[0]["labels"].get(key).is_none(), "the control plane is labelled for the device plugin");
    }
    let image = plugin[0]["spec"]["template"]["spec"]["containers"][0]["image"].as_str().expect("the plugin's image");
    assert!(
        image.starts_with("nvcr.io/nvidia/k8s-device-plugin:v") && !image.ends_with(":latest"),
        "the device plugin's image must be pinned: {image}"
    );

    let images: BTreeSet<&str> =
        nodes.iter().map(|n| n["image"].as_str().expect("every node names its image")).collect();
    assert_eq!(images.len(), 1, "one node image for all nodes: {images:?}");
    let node_image = images.first().expect("a node image");
    assert!(
        node_image.starts_with("kindest/node:v") && node_image.contains("@sha256:"),
        "pin the node image by digest: {node_image}"
    );

    let name = config["name"].as_str().expect("the cluster's name");
    let common = read(&kind_dir().join("common.sh"));
    assert!(
        common.contains(&format!("CLUSTER_NAME=${{TENSORFLEET_KIND_CLUSTER:-{name}}}")),
        "common.sh's default cluster name is not kind-config.yaml's {name}"
    );
}

/// (d) Every TrainingJob the kind scenarios run asks for GPUs and trains on them: it reads as
/// the operator's TrainingJob type, its training configuration is valid, data × tensor ×
/// pipeline is its world size (slotsPerWorker, else the GPU limit), and every pod of the
/// manifests runs the worker image up.sh builds.
#[test]
fn every_kind_training_job_asks_for_gpus_and_trains_with_cuda() {
    let worker_image = format!("tensorfleet/worker:{VERSION}");
    let mut jobs = BTreeSet::new();
    for file in manifests() {
        for doc in file_documents(&file) {
            let origin = format!("{} ({} {})", file.display(), doc["kind"], doc["metadata"]["name"]);
            let images = images(&doc);
            assert!(
                images.iter().all(|i| *i == worker_image),
                "{origin}: images {images:?}, up.sh builds {worker_image}"
            );
            if doc["kind"] != "TrainingJob" {
                continue;
            }
            assert_eq!(doc["apiVersion"], "tensorfleet.dev/v1alpha1", "{origin}");
            let job: TrainingJob =
                serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("{origin}: not a TrainingJob: {e}"));
            assert!(jobs.insert(job.metadata.name.clone().expect("a name")), "{origin}: a second job of that name");
            let gpus = job
                .spec
                .resources
                .as_ref()
                .and_then(|r| r.limits.as_ref())
                .and_then(|l| l.get("nvidia.com/gpu"))
                .and_then(|q| q.0.parse::<i32>().ok())
                .unwrap_or(0);
            assert!(gpus >= 1, "{origin}: resources.limits has no nvidia.com/gpu");
            assert_eq!(doc["spec"]["training"]["device"], "cuda", "{origin}: training.device");
            job.spec.training.validate(&format!("{origin}: spec.training")).unwrap_or_else(|e| panic!("{e}"));
            let p = &job.spec.training.parallelism;
            assert_eq!(
                (p.data * p.tensor * p.pipeline) as i32,
                job.world_size(),
                "{origin}: data × tensor × pipeline must be workers × slotsPerWorker"
            );
            // One rank per GPU: a rank without its own GPU would share one, which NCCL refuses.
            assert_eq!(job.slots_per_worker(), gpus, "{origin}: slotsPerWorker must equal the GPU limit");
        }
    }
    // What run-scenarios.sh applies by name (scenarios 1, 2, 3 and 8).
    let want: BTreeSet<String> =
        ["gpu-quickstart", "single", "three-d", "gpu-restart", "gpu-delete"].map(String::from).into();
    assert_eq!(jobs, want, "the TrainingJobs of e2e/kind/manifests");

    // The smoke pod of up.sh asks for exactly one GPU.
    let smoke = file_documents(&kind_dir().join("manifests/gpu-smoke.yaml"));
    assert_eq!(smoke[0]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"], json!(1));
}

/// The images a manifest's pods run: a Pod's containers, or a TrainingJob's spec.image.
fn images(doc: &Value) -> Vec<&str> {
    match doc["kind"].as_str() {
        Some("TrainingJob") => vec![doc["spec"]["image"].as_str().unwrap_or_default()],
        Some("Pod") => doc["spec"]["containers"]
            .as_array()
            .into_iter()
            .flatten()
            .chain(doc["spec"]["initContainers"].as_array().into_iter().flatten())
            .map(|c| c["image"].as_str().unwrap_or_default())
            .collect(),
        _ => vec![],
    }
}

/// values-kind.yaml names only keys of the chart's values.yaml (helm ignores a misspelt key
/// without a word), loads the images up.sh builds, and never pulls them.
#[test]
fn kind_values_name_only_keys_the_chart_has() {
    let read_values = |path: PathBuf| -> Value {
        serde_yaml::from_str(&read(&path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let chart = read_values(repo().join("charts/tensorfleet/values.yaml"));
    let kind = read_values(kind_dir().join("values-kind.yaml"));
    let mut unknown = Vec::new();
    unknown_keys(&kind, &chart, "", &mut unknown);
    assert!(unknown.is_empty(), "values-kind.yaml keys the chart does not have: {unknown:?}");
    assert_eq!(kind["image"]["repository"], "tensorfleet/operator");
    assert_eq!(kind["workerImage"]["repository"], "tensorfleet/worker");
    assert_eq!(kind["image"]["pullPolicy"], "Never");
}

/// The key paths of `values` that `chart` lacks. Maps the chart leaves empty (`{}`, for the
/// user's own keys, like podLabels) take anything.
fn unknown_keys(values: &Value, chart: &Value, prefix: &str, unknown: &mut Vec<String>) {
    let (Some(values), Some(chart)) = (values.as_object(), chart.as_object()) else { return };
    if chart.is_empty() {
        return;
    }
    for (key, value) in values {
        let path = format!("{prefix}{key}");
        match chart.get(key) {
            None => unknown.push(path),
            Some(inner) => unknown_keys(value, inner, &format!("{path}."), unknown),
        }
    }
}

#[test]
fn unknown_keys_finds_a_misspelt_key_and_accepts_free_form_maps() {
    let chart = json!({"image": {"repository": "r", "tag": ""}, "podLabels": {}});
    let mut unknown = Vec::new();
    unknown_keys(&json!({"image": {"repo": "x"}, "podLabels": {"a": "b"}, "imgae": 1}), &chart, "", &mut unknown);
    assert_eq!(unknown, ["image.repo", "imgae"]);
}
