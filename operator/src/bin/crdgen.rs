//! Prints the TrainingJob CustomResourceDefinition as YAML (`make crds` writes it to `crds/`
//! and to the chart; a unit test of `crd.rs` checks that the committed files match).

fn main() {
    match tensorfleet_operator::crd::crd_yaml() {
        Ok(yaml) => print!("{yaml}"),
        Err(e) => {
            eprintln!("crdgen: cannot serialize the CRD: {e}");
            std::process::exit(1);
        }
    }
}
