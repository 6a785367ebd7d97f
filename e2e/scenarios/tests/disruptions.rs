//! The end-to-end scenarios that disrupt the whole cluster: a node lost, the API server and the
//! operator restarted. Every job on the cluster would feel them, so `make e2e` runs each alone,
//! after the scenarios of scenarios.rs (e2e/scenarios/run.sh).

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams};
use kube::ResourceExt;
use serde_json::json;
use tensorfleet_e2e::{long_quickstart, losses, metrics, phase, wait_for_path, Cluster, TRAINING};

/// Scenario 5: restarting the operator mid-job (deleting its pod; the Deployment makes a new
/// one) duplicates and orphans nothing, and the job completes.
#[tokio::test]
#[ignore = "needs the local cluster of `make e2e` (TENSORFLEET_E2E_CLUSTER)"]
async fn restarting_the_operator_mid_job_duplicates_nothing_and_the_job_completes() {
    let cluster = Cluster::connect().await;
    let ns = cluster.namespace("operator-restart").await;
    cluster.prepare_data(&ns).await;
    cluster.apply_job(&ns, &long_quickstart("steady")).await.expect("applying the job");
    cluster.wait_job(&ns, "steady", TRAINING, "the job to run", |j| phase(j) == "Running").await;
    let claim = cluster.claim_dir(&ns, "steady-ckpt").await;
    wait_for_path(&claim.join("out/checkpoints/checkpoint_10"), TRAINING).await;
    let before: Vec<String> =
        cluster.pods(&ns, "worker").await.iter().map(|p| p.metadata.uid.clone().unwrap()).collect();
    let operators: Api<Pod> = Api::namespaced(cluster.client.clone(), "tensorfleet-system");
    let lp = ListParams::default().labels("app.kubernetes.io/name=tensorfleet");
    let old = operators.list(&lp).await.unwrap().items;
    assert_eq!(old.len(), 1, "one operator pod expected");
    operators
        .delete(&old[0].metadata.name.clone().unwrap(), &DeleteParams::default())
        .await
        .expect("deleting the operator pod");

    let job = cluster
        .wait_job(&ns, "steady", TRAINING, "the job to succeed across the operator's restart", |j| {
            assert_ne!(phase(j), "Failed", "{:?}", j.status);
            phase(j) == "Succeeded"
        })
        .await;
    let status = job.status.unwrap();
    assert_eq!(status.restart_count, 0, "the operator's restart restarted the job: {status:?}");
    let new = operators.list(&lp).await.unwrap().items;
    assert!(new.iter().all(|p| p.metadata.uid != old[0].metadata.uid), "the operator pod was not replaced");
    // The same worker pods throughout (none recreated), and exactly one launcher.
    let after: Vec<String> =
        cluster.pods(&ns, "worker").await.iter().map(|p| p.metadata.uid.clone().unwrap()).collect();
    assert!(after.iter().all(|uid| before.contains(uid)), "worker pods were recreated: {before:?} → {after:?}");
    let launchers = cluster.pods(&ns, "launcher").await;
    assert_eq!(launchers.len(), 1, "{} launcher pods", launchers.len());
    cluster.delete_namespace(&ns).await;
}

/// The API server killed and started again mid-job: the operator's watches come back, no pod
/// is duplicated, recreated or orphaned, and the job completes without a restart.
#[tokio::test]
#[ignore = "needs the local cluster of `make e2e` (TENSORFLEET_E2E_CLUSTER)"]
async fn restarting_the_api_server_mid_job_duplicates_nothing_and_the_job_completes() {
    let cluster = Cluster::connect().await;
    let ns = cluster.namespace("apiserver-restart").await;
    cluster.prepare_data(&ns).await;
    // The quickstart's own batch (a step four times the long job's), so that most of the training
    // comes after the restart. With the long job's, the job ended 20 s after the restart and the
    // operator saw it Succeeded 2.5 minutes later (2026-11-27, not understood yet: its watches
    // failed with "client error (SendRequest)" two minutes after the restart).
    let mut manifest = long_quickstart("steady");
    tensorfleet_e2e::merge(
        &mut manifest["spec"]["training"],
        json!({"batchSize": 8, "model": {"gpt2": {"seqLen": 64}}}),
    );
    cluster.apply_job(&ns, &manifest).await.expect("applying the job");
    cluster.wait_job(&ns, "steady", TRAINING, "the job to run", |j| phase(j) == "Running").await;
    let claim = cluster.claim_dir(&ns, "steady-ckpt").await;
    wait_for_path(&claim.join("out/checkpoints/checkpoint_10"), TRAINING).await;
    let uids = |pods: Vec<Pod>| pods.iter().map(|p| p.metadata.uid.clone().unwrap()).collect::<Vec<_>>();
    let workers = uids(cluster.pods(&ns, "worker").await);
    let launcher = uids(cluster.pods(&ns, "launcher").await);
    cluster.restart_api_server().await;

    let job = cluster
        .wait_job(&ns, "steady", TRAINING, "the job to succeed across the API server's restart", |j| {
            assert_ne!(phase(j), "Failed", "{:?}", j.status);
            phase(j) == "Succeeded"
        })
        .await;
    let status = job.status.unwrap();
    assert_eq!(status.restart_count, 0, "the API server's restart restarted the job: {status:?}");
    assert_eq!(uids(cluster.pods(&ns, "worker").await), workers, "worker pods were recreated or duplicated");
    assert_eq!(uids(cluster.pods(&ns, "launcher").await), launcher, "the launcher was recreated or duplicated");
    // Nothing in the namespace without the job as its owner but the data's pod.
    let all = Api::<Pod>::namespaced(cluster.client.clone(), &ns).list(&ListParams::default()).await.unwrap();
    for p in all.items.iter().filter(|p| p.metadata.name.as_deref() != Some("prepare-data")) {
        assert!(p.metadata.owner_references.as_ref().is_some_and(|o| !o.is_empty()), "orphan pod {}", p.name_any());
    }
    cluster.delete_namespace(&ns).await;
}

/// A node lost mid-job (its containers, kubelet and runtime stopped at once, as a power cut
/// would): once it has been not Ready for spec.runPolicy.nodeLostAfterSeconds, the gang restarts
/// on the other nodes (its pods there removed at once, their kubelet being gone) and resumes from
/// the newest checkpoint to the end. The node comes back afterwards.
#[tokio::test]
#[ignore = "needs the local cluster of `make e2e` (TENSORFLEET_E2E_CLUSTER)"]
async fn a_lost_node_restarts_the_gang_on_the_other_nodes_which_resumes() {
    let cluster = Cluster::connect().await;
    let ns = cluster.namespace("lost-node").await;
    cluster.prepare_data(&ns).await;
    let mut manifest = long_quickstart("lost");
    manifest["spec"]["runPolicy"]["nodeLostAfterSeconds"] = json!(10);
    // Off the node that keeps the cluster's services, which must not be the one lost.
    let not_there = json!({"key": "kubernetes.io/hostname", "operator": "NotIn", "values": [cluster.system_node()]});
    manifest["spec"]["scheduling"]["affinity"] = json!({"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [not_there]}]}}});
    cluster.apply_job(&ns, &manifest).await.expect("applying the job");
    cluster.wait_job(&ns, "lost", TRAINING, "the job to run", |j| phase(j) == "Running").await;
    let claim = cluster.claim_dir(&ns, "lost-ckpt").await;
    wait_for_path(&claim.join("out/checkpoints/checkpoint_10"), TRAINING).await;
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), &ns);
    let node_of = |p: &Pod| p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default();
    // The launcher's node: with it go mpirun and every rank's daemon, the other pods keep
    // running their sshd, so only the node's loss tells the operator (and a worker may be there).
    let victim = node_of(&pods.get("lost-launcher").await.expect("the launcher"));
    let stopped = cluster.stop_node(&victim).await;

    let job = cluster
        .wait_job(&ns, "lost", TRAINING, &format!("the job to succeed without node {victim}"), |j| {
            assert_ne!(phase(j), "Failed", "{:?}", j.status);
            phase(j) == "Succeeded"
        })
        .await;
    cluster.restart_node(stopped).await;
    let status = job.status.unwrap();
    assert!(status.restart_count >= 1, "the gang did not restart: {status:?}");
    for p in pods.list(&ListParams::default().labels("tensorfleet.dev/job-name=lost")).await.unwrap() {
        assert_ne!(node_of(&p), victim, "{} ran on the lost node after the restart", p.name_any());
    }
    let steps = losses(&metrics(&claim.join("out/metrics.jsonl")));
    assert_eq!(steps.keys().copied().collect::<Vec<u64>>(), (1..=60).collect::<Vec<u64>>(), "{status:?}");
    let failure = status.failure.expect("the cause of the restart");
    assert_eq!(failure.reason, "NodeLost", "{failure:?}");
    assert!(failure.message.contains(&victim), "{failure:?}");
    cluster.delete_namespace(&ns).await;
}
